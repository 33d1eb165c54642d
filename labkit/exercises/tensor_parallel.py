"""Lesson 03's exercises: write the forward of a row-parallel linear (the checker runs it on 2
ranks against the full layer and says what is wrong, in plain words), and count the bytes one
GPU sends per transformer block under TP (`check_block_bytes`, against
`theory.tensor_parallel.block_wire_bytes`), and find the tokens at which async TP's ring hides
(`check_break_even_tokens`, against `theory.async_tp.break_even_tokens`)."""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Check, Mistake, check_number, say
from ..theory import hardware
from ..theory.async_tp import break_even_tokens
from ..theory.tensor_parallel import block_wire_bytes
from ..parallel.tensor_parallel import reduce_from_tp


def row_parallel_forward(ctx, x_shard, weight_shard, bias, group):
    """One answer: partial sums, one all-reduce (g, inside autograd), then the bias, once."""
    return reduce_from_tp(F.linear(x_shard, weight_shard), group, "exercise") + bias


def _exercise_rank(ctx, fn):
    torch.manual_seed(0)
    full = nn.Linear(8, 6)
    x = torch.randn(4, 8, requires_grad=True)
    t, r = ctx.world_size, ctx.rank
    cols = slice(r * 8 // t, (r + 1) * 8 // t)
    x_shard = x.detach()[:, cols].clone().requires_grad_()
    w_shard = full.weight.detach()[:, cols].clone().requires_grad_()
    bias = full.bias.detach().clone().requires_grad_()
    expected = full(x)
    out = {"rank": r}
    warnings.simplefilter("ignore")  # an all-reduce outside autograd warns in backward
    try:
        y = fn(ctx, x_shard, w_shard, bias, ctx.world)
    except Exception as error:  # noqa: BLE001 - the learner's code: report, never crash
        out["error"] = f"{type(error).__name__}: {error}"
        return out
    out["calls"] = [rec.op for rec in ctx.comm.records]
    if not isinstance(y, torch.Tensor) or y.shape != expected.shape:
        out["shape"] = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        return out
    out["partial"] = F.linear(x_shard, w_shard).detach()
    out["y"], out["expected"], out["bias"] = y.detach(), expected.detach(), bias.detach()
    if y.requires_grad:
        y.sum().backward()
        expected.sum().backward()
        out["grad_ok"] = torch.allclose(w_shard.grad, full.weight.grad[:, cols], atol=1e-5)
    return out


def check_row_parallel(fn, world_size=2, verbose=True):
    """Run the learner's `fn(ctx, x_shard, weight_shard, bias, group)` on `world_size` ranks;
    print the feedback and return a Check."""
    from ..runtime.launch import LaunchError, launch
    try:
        results = launch(_exercise_rank, world_size, fn, timeout_s=60)
    except LaunchError as error:
        return say(Check(False, "hang", "Your function did not finish on every rank: "
                         + str(error).splitlines()[0] + ". Every rank must call the same "
                         "collectives in the same order."), verbose)
    return say(_judge(results[0], world_size), verbose)


def _judge(r0, world_size):
    width = 8 // world_size
    if "error" in r0 and r0["error"].startswith("NotImplementedError"):
        return Check(False, "not written", "NOT WRITTEN YET: your function raised "
                     "NotImplementedError. Hint: each rank's F.linear(x_shard, weight_shard) is a "
                     "partial sum of the output: add them over the ranks, then the bias.")
    if "error" in r0:
        return Check(False, "error", f"Your function raised {r0['error']}. x_shard is (4, "
                     f"{width}), weight_shard (6, {width}): F.linear(x_shard, weight_shard) "
                     "fits.")
    if "shape" in r0:
        return Check(False, "shape", f"The output has shape {r0['shape']}, the full layer's is "
                     "(4, 6). A row-parallel linear gives every rank the whole output: sum the "
                     "partial results, do not concatenate them (that would be all_gather, for "
                     "column-parallel outputs).")
    y, expected, bias, partial = r0["y"], r0["expected"], r0["bias"], r0["partial"]
    if torch.allclose(y, expected, atol=1e-5):
        if r0.get("grad_ok") is False:
            return Check(False, "gradient", "The output is right but the weight gradient is "
                         "not: keep the all-reduce inside the autograd graph (reduce_from_tp: "
                         "all-reduce forward, identity backward).")
        return Check(True, "", "Correct: each rank multiplies its slice of the input features "
                     "by its slice of the weight, one all-reduce sums the partial results, and "
                     f"the bias is added once, after it. Communication: {', '.join(r0['calls'])}.")
    if torch.allclose(y, partial + bias, atol=1e-5) or torch.allclose(y, partial, atol=1e-5):
        return Check(False, "no sum", "Each rank returns only its own partial sum X_i A_i^T: "
                     "the results of the ranks are never added. Sum them with one all-reduce "
                     "over the group (e.g. reduce_from_tp(y, group)) before adding the bias.")
    if torch.allclose(y, expected + (world_size - 1) * bias, atol=1e-5):
        return Check(False, "bias", f"The bias is counted {world_size} times: every rank added "
                     "it before the all-reduce summed the ranks. Add the bias after the "
                     "all-reduce, once.")
    return Check(False, "wrong", "The output differs from the full layer's (max difference "
                 f"{(y - expected).abs().max():.3g}). Compute F.linear(x_shard, weight_shard) "
                 "without bias, all-reduce (sum) it over the group, then add the bias.")


BLOCK = dict(batch=1, seq=4096, hidden=8192, tp=8)   # Llama 3 70B's width, one node of TP


def check_block_bytes(answer, batch=BLOCK["batch"], seq=BLOCK["seq"], hidden=BLOCK["hidden"],
                      tp=BLOCK["tp"], verbose=True):
    """Bytes one GPU sends per transformer block and micro-batch, forward + backward, bf16,
    without sequence parallelism (ring all-reduces)."""
    t, size = tp, batch * seq * hidden * 2          # S: one b x s x h bf16 activation
    expected = block_wire_bytes(batch, seq, hidden, tp)
    ring = 2 * (t - 1) / t * size
    mistakes = [
        Mistake(2 * ring, "half the calls", "off by a factor 2: count forward and backward, "
                "2 all-reduces each (g after attention and after the MLP in forward, f before "
                "them in backward)"),
        Mistake(ring, "one call", "that is one all-reduce; a block runs 4 (2 forward, 2 "
                "backward)"),
        Mistake(4 * size, "payload", f"that counts S per all-reduce; a ring all-reduce sends "
                f"2(t-1)/t x S per rank (2 x {t - 1}/{t})"),
        Mistake(4 * (t - 1) / t * size, "one phase", "off by a factor 2: a ring all-reduce "
                "sends each byte twice, once in reduce-scatter and once in all-gather"),
        Mistake(2 * expected, "fp32", "that counts 4 bytes per value; the activations are "
                "bf16, 2 bytes each"),
    ]
    return check_number(answer, expected, what=f"bytes one GPU sends per block (b={batch}, "
                        f"s={seq}, h={hidden}, t={t}, bf16)", unit="bytes", mistakes=mistakes,
                        verbose=verbose,
                        hint="S = b x s x h x 2 bytes; 2 all-reduces forward + 2 backward, each "
                             "2(t-1)/t x S per rank.",
                        explain="Every layer of the model sends this, on the critical path.")


RING = dict(in_features=8192, out_features=28672, tp=8, cluster="8xH100-NVLink")


def check_break_even_tokens(answer, in_features=RING["in_features"],
                            out_features=RING["out_features"], tp=RING["tp"],
                            cluster=RING["cluster"], verbose=True):
    """Tokens per micro-batch at which one chunk's matmul (colwise, SP, bf16) lasts as long as
    the ring message carrying the chunk (theory.async_tp.break_even_tokens)."""
    c = hardware.cluster(cluster)
    link, peak = c.link_for(range(tp)), c.gpu.flops("bf16")
    expected = break_even_tokens(in_features, out_features, tp, cluster=cluster)

    def solve(flops_per_s=peak * c.mfu, bytes_per_value=2, bandwidth=link.effective_bandwidth,
              outputs=out_features / tp):
        per_token = in_features * (2 * outputs / flops_per_s - bytes_per_value / bandwidth)
        return tp * link.latency / per_token
    mistakes = [
        Mistake(0.0, "no latency", "without the latency alpha both times grow in proportion to "
                "T, so no T is special: it is alpha, paid per message, that the matmul covers"),
        Mistake(solve(flops_per_s=peak), "peak", f"that runs the matmul at peak; the lab "
                f"models mfu = {c.mfu} of it"),
        Mistake(solve(bytes_per_value=4), "fp32", "that sends 4 bytes per value; bf16 is 2"),
        Mistake(solve(bandwidth=link.bandwidth), "line rate", f"that uses the line rate; the "
                f"link delivers {link.efficiency:.0%} of it (effective_bandwidth)"),
        Mistake(solve(outputs=out_features), "all outputs", "a rank multiplies only its h_out/t "
                "output features (colwise)"),
    ]
    return check_number(answer, expected, what=f"tokens per micro-batch at which the ring hides "
                        f"({in_features}->{out_features}, t={tp}, {c.gpu.name} over {link.name})",
                        unit="tokens", mistakes=mistakes, verbose=verbose,
                        hint="a chunk is T/t tokens: 2 (T/t) h_in (h_out/t) / (mfu x peak) = "
                             "alpha + (T/t) h_in x 2 bytes / effective bandwidth; solve for T.",
                        explain="Above it the whole all-gather hides under the chunk matmuls.")
