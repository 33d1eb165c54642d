"""Lesson 09's exercises: write one tensor-parallel decode step of attention (the checker runs
it on 2 ranks, prefill then three decode steps, against labkit's Attention with a KV cache, and
says what is wrong), the KV-cache bytes of Llama 3 70B (GQA), and the lowest time per output
token of Llama 3 8B on one H100 (`check_kv_bytes`, `check_tpot_floor`, against
`labkit.theory.serving`)."""
import warnings

import torch
import torch.nn.functional as F

from . import (Check, Hints, Mistake, check_number, not_a_function, not_started, say, show,
               with_hint)
from ..models import Attention, causal_attention
from ..parallel.serving import KVCache
from ..theory import catalog, hardware
from ..theory import serving as theory

HIDDEN, HEADS, STEPS = 16, 4, 4       # the exercise's attention: 4 heads of 4; prefill + 3


def attention_decode_step(ctx, x, shard, cache, group):
    """One answer: this rank's heads' q, k, v; the cache grows; partial projection; one
    all-reduce; the bias once, after it."""
    q, k, v = F.linear(x, shard["w_qkv"], shard["b_qkv"]).chunk(3, dim=-1)
    if "k" in cache:
        k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
    cache["k"], cache["v"] = k, v
    out = causal_attention(q, k, v, q.shape[-1] // shard["head_dim"])
    partial = F.linear(out, shard["w_proj"])
    return ctx.comm.all_reduce(partial, group=group, tag="attention out") + shard["b_proj"]


def _shard(attn, rank, world):
    """This rank's heads: rows of q, k and v of its heads, columns of the output projection."""
    h, per = HIDDEN, HIDDEN // world
    rows = torch.cat([torch.arange(part * h + rank * per, part * h + (rank + 1) * per)
                      for part in range(3)])
    return dict(w_qkv=attn.qkv.weight.detach()[rows].clone(),
                b_qkv=attn.qkv.bias.detach()[rows].clone(),
                w_proj=attn.proj.weight.detach()[:, rank * per:(rank + 1) * per].clone(),
                b_proj=attn.proj.bias.detach().clone(), head_dim=HIDDEN // HEADS)


def _exercise_rank(ctx, fn):
    torch.manual_seed(0)
    attn = Attention(HIDDEN, HEADS)
    seq = torch.randn(2, 6 + STEPS - 1, HIDDEN, generator=torch.Generator().manual_seed(1))
    inputs = [seq[:, :6]] + [seq[:, i:i + 1] for i in range(6, 6 + STEPS - 1)]
    reference, ref_cache = [], KVCache()
    with torch.no_grad():
        for x in inputs:
            reference.append(attn(x, kv_cache=ref_cache))
    shard, cache = _shard(attn, ctx.rank, ctx.world_size), {}
    out = dict(rank=ctx.rank, reference=reference, outputs=[], calls=[], flops=[])
    warnings.simplefilter("ignore")
    try:
        with torch.no_grad():
            for x in inputs:
                before, flops = len(ctx.comm.records), ctx.clock.flops
                with ctx.clock.compute("decode step"):   # labkit's FLOP counter
                    got = fn(ctx, x, shard, cache, ctx.world)
                out["flops"].append(ctx.clock.flops - flops)
                out["calls"].append([r.op for r in list(ctx.comm.records)[before:]])
                out["outputs"].append(got.detach().float() if isinstance(got, torch.Tensor)
                                      and got.is_floating_point() else got)
    except Exception as error:  # noqa: BLE001 - the learner's code: report, never crash
        out["error"] = f"{type(error).__name__}: {error}"
        return out
    out["answer_flops"] = _answer_flops(ctx, inputs, _shard(attn, ctx.rank, ctx.world_size))
    out["cache_len"] = cache["k"].shape[1] if isinstance(cache.get("k"), torch.Tensor) else 0
    out["cache_width"] = cache["k"].shape[-1] if out["cache_len"] else 0
    out["b_proj"] = shard["b_proj"]
    return out


def _answer_flops(ctx, inputs, shard):
    """The FLOPs of each step of the model answer (a KV cache), counted the same way."""
    cache, flops = {}, []
    with torch.no_grad():
        for x in inputs:
            before = ctx.clock.flops
            with ctx.clock.compute("answer step"):
                attention_decode_step(ctx, x, shard, cache, ctx.world)
            flops.append(ctx.clock.flops - before)
    return flops


STEP_HINTS = Hints(
    concept="each rank owns some heads: their rows of w_qkv give this rank's q, k, v, and "
            "their columns of w_proj a partial sum of the output, which the ranks add; the "
            "keys and values of earlier tokens never change, so keep them and compute k and v "
            "for the new tokens only.",
    code="q, k, v = F.linear(x, shard['w_qkv'], shard['b_qkv']).chunk(3, dim=-1); if 'k' in "
         "cache: k, v = torch.cat([cache['k'], k], 1), torch.cat([cache['v'], v], 1); "
         "cache['k'], cache['v'] = k, v; out = causal_attention(q, k, v, q.shape[-1] // "
         "shard['head_dim']); return ctx.comm.all_reduce(F.linear(out, shard['w_proj']), "
         "group=group) + shard['b_proj']")
KV_HINTS = Hints(
    concept="every layer keeps, for every token of every request, a key and a value vector "
            "for each KV head (grouped-query attention: fewer KV heads than query heads).",
    code="layers x 2 (k, v) x kv_heads x head_dim x tokens x requests x 2 bytes (bf16).",
    exercise=2, kind="formula")
TPOT_HINTS = Hints(
    concept="at batch 1 each new token needs every weight once, read from HBM; the GPU's "
            "FLOPs are not the limit, its memory bandwidth is.",
    code="weight bytes (parameters x 2, bf16) / HBM bandwidth, in milliseconds.",
    exercise=3, kind="formula")
HINTS = {1: STEP_HINTS, 2: KV_HINTS, 3: TPOT_HINTS}


def show_solution(exercise=1):
    """Print the code (exercise 1) or the formula (2, 3)."""
    show(HINTS, exercise)


def check_tp_decode_step(fn, world_size=2, verbose=True):
    """Run the learner's `fn(ctx, x, shard, cache, group)` for a prompt and three decode steps
    on `world_size` ranks; print the feedback and return a Check."""
    from ..runtime.launch import LaunchError, launch
    if (refused := not_a_function(fn, "fn(ctx, x, shard, cache, group)")) is not None:
        return say(refused, verbose)
    try:
        results = launch(_exercise_rank, world_size, fn, timeout_s=90)
    except LaunchError as error:
        busy = not_started(str(error))
        check = Check(False, "slow", busy) if busy else Check(
            False, "hang", "Your step did not finish on every rank: "
            + str(error).splitlines()[0] + ". Every rank must call the same collectives in the "
            "same order.")
    else:
        check = _diagnose(results, world_size)
    check = with_hint(check, STEP_HINTS)
    return say(check, verbose)


def _diagnose(results, world_size):
    first = results[0]
    if "error" in first and first["error"].startswith("NotImplementedError"):
        return Check(False, "not written", "NOT WRITTEN YET: your function raised "
                     "NotImplementedError. Hint: q, k, v = the linear of x by this rank's "
                     "w_qkv, b_qkv, in thirds; append k and v to the cache; attend; project "
                     "with w_proj; all-reduce over the group; add b_proj.")
    if "error" in first:
        return Check(False, "error", f"Your step raised {first['error']}")
    outputs, reference = first["outputs"], first["reference"]
    if any(not isinstance(o, torch.Tensor) or not o.is_floating_point()
           or o.shape != r.shape for o, r in zip(outputs, reference)):
        return Check(False, "shape", "Return the attention output for this step's tokens: "
                     f"shapes {[tuple(r.shape) for r in reference]}.")
    reduces = [sum(op == "all_reduce" for op in calls) for calls in first["calls"]]
    if max(reduces) == 0:
        return Check(False, "no all-reduce", "No all-reduce: each rank's projection of its own "
                     "heads is a partial sum; add them with ctx.comm.all_reduce(..., "
                     "group=group) before the bias.")
    if any(n != 1 for n in reduces):
        return Check(False, "too many collectives", f"{reduces} all-reduces per step: one is "
                     "enough (after the output projection); q, k and v need none.")
    last, want = outputs[-1], reference[-1]
    bias = first["b_proj"]
    if torch.allclose(last, want + (world_size - 1) * bias, atol=1e-5):
        return Check(False, "bias summed", f"The bias is added {world_size} times: add it "
                     "once, after the all-reduce (each rank added it before the sum).")
    if not torch.allclose(outputs[0], reference[0], atol=1e-5):
        return Check(False, "prefill", "The prompt's output is wrong already, before any "
                     "decode step (q|k|v come in thirds; heads = width / head_dim on this "
                     "rank).")
    if first["cache_len"] != 6 + STEPS - 1:
        return Check(False, "cache", f"The cache holds {first['cache_len']} positions after "
                     f"the last step, not {6 + STEPS - 1}: append each step's k and v to "
                     "cache['k'] and cache['v'] (along the sequence, dim 1) and attend over all.")
    if not all(torch.allclose(o, r, atol=1e-5) for o, r in zip(outputs, reference)):
        return Check(False, "decode", "The prompt is right but a decode step is not: a new "
                     "token attends to every cached key, its own included (causal_attention "
                     "handles k longer than q).")
    recomputed = [i for i in range(1, len(outputs))
                  if first["flops"][i] > 1.5 * first["answer_flops"][i]]
    if recomputed:
        i = recomputed[-1]
        return Check(False, "no cache", f"RIGHT VALUES, NO CACHE: decode step {i} ran "
                     f"{first['flops'][i]:,.0f} FLOPs on rank 0 (labkit's FLOP counter), "
                     f"{first['flops'][i] / first['answer_flops'][i]:.1f}x the "
                     f"{first['answer_flops'][i]:,.0f} of a step with a KV cache, as if the "
                     f"keys and values of all {6 + i} tokens were computed again each step: a "
                     "step's cost then grows with the context. Compute k and v for the new "
                     "token only and append them to cache['k'] and cache['v'].")
    width = first["cache_width"]
    return Check(True, "", f"Correct on {world_size} ranks: the prompt and {STEPS - 1} decode "
                 f"steps equal one device, one all-reduce per step, and each rank's cache holds "
                 f"only its own heads ({width} of {HIDDEN} features per token).")


# ------------------------------------------------------------------------------- numbers

KV_CASE = dict(model="llama-3-70b", batch=8, context=8192)


def check_kv_bytes(answer, verbose=True, **case):
    """KV-cache bytes of Llama 3 70B for `batch` requests of `context` tokens, bf16."""
    c = dict(KV_CASE, **case)
    m = catalog.model(c["model"])
    expected = theory.kv_cache_bytes(m, c["batch"], c["context"])
    mistakes = [
        Mistake(expected / 2, "forgot k or v", "the cache keeps keys AND values"),
        Mistake(expected / 2, "values, not bytes", "that counts values; each bf16 value is 2 "
                "bytes"),
        Mistake(expected * 2, "fp32", "that counts 4 bytes per value; the cache is bf16"),
        Mistake(expected / c["batch"], "one request", f"that is one request; the cache holds "
                f"all {c['batch']}"),
        Mistake(expected * m.heads / m.kv_heads, "no GQA", f"Llama 3 has {m.kv_heads} KV heads "
                f"shared by its {m.heads} query heads (grouped-query attention): use kv_heads"),
        Mistake(expected / m.layers, "one layer", f"every one of the {m.layers} layers keeps "
                "its own keys and values"),
        ]
    return check_number(answer, expected, unit="bytes", mistakes=mistakes, verbose=verbose,
                        what=f"the KV cache of {m.display_name}, {c['batch']} requests x "
                             f"{c['context']} tokens, bf16",
                        hints=KV_HINTS,
                        explain=f"{expected / 1e9:.1f} GB: beside the bf16 weights' "
                                f"{theory.weight_bytes(m)['total'] / 1e9:.0f} GB, and it grows "
                                "with every user and every token.")


def check_tpot_floor(answer_ms, verbose=True, model="llama-3-8b", gpu="H100"):
    """The lowest time per output token at batch 1 (bf16 weights, cache ignored): every weight
    is read from HBM once per token. In milliseconds."""
    m, g = catalog.model(model), hardware.gpu(gpu)
    weights = theory.weight_bytes(m)["total"]
    expected = weights / g.memory_bw * 1e3
    flops_ms = 2 * m.param_count() / g.bf16_flops * 1e3
    mistakes = [
        Mistake(flops_ms, "compute, not memory", "that is the time of the FLOPs; at batch 1 "
                "the GPU waits for the weights to arrive from memory: bytes / bandwidth"),
        Mistake(expected / 2, "1 byte per weight", "bf16 is 2 bytes per weight"),
        Mistake(expected * 8, "bits", "that divides bits by bytes per second"),
        Mistake(expected / 1e3, "seconds", "give milliseconds"),
        Mistake(expected * 2, "fp32 weights", "that reads 4 bytes per weight; the weights are "
                "bf16, 2 bytes"),
        Mistake(1e3 / expected, "tokens per second", "that is tokens per second, the inverse; "
                "give the milliseconds per token")]
    return check_number(answer_ms, expected, unit="ms", mistakes=mistakes, verbose=verbose,
                        tolerance=0.02,
                        what=f"the floor of the time per token of {m.display_name} on one "
                             f"{g.name}, batch 1",
                        hints=TPOT_HINTS,
                        explain=f"at most {1e3 / expected:.0f} tokens/s for one user, however "
                                "many FLOP/s the GPU has; a batch shares each read.")
