"""Lesson 03's exercises: write the forward of a row-parallel linear (the checker runs it on 2
ranks against the full layer and says what is wrong, in plain words), and count the bytes one
GPU sends per transformer block under TP (`check_block_bytes`, against
`theory.tensor_parallel.block_wire_bytes`), and find the tokens at which async TP's ring hides
(`check_break_even_tokens`, against `theory.async_tp.break_even_tokens`)."""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import (Check, Hints, Mistake, check_number, not_a_function, not_started, say, show,
               with_hint)
from ..theory import hardware
from ..theory.step_rate import in_step_gemm_rate
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
    out["y_dtype"] = str(y.dtype)
    if not y.is_floating_point():
        return out
    if not y.requires_grad:
        out["grad_ok"] = None           # no graph at all: the weight can get no gradient
        return out
    try:
        y.float().sum().backward()
    except RuntimeError as error:       # e.g. an in-place all-reduce on a tensor autograd saved
        out["grad_error"] = str(error).splitlines()[0]
        return out
    expected.sum().backward()
    out["grad_ok"] = None if w_shard.grad is None else \
        torch.allclose(w_shard.grad, full.weight.grad[:, cols], atol=1e-5)
    return out


def check_row_parallel(fn, world_size=2, verbose=True):
    """Run the learner's `fn(ctx, x_shard, weight_shard, bias, group)` on `world_size` ranks;
    print the feedback and return a Check."""
    from ..runtime.launch import LaunchError, launch
    if (refused := not_a_function(fn, "fn(ctx, x_shard, weight_shard, bias, group)")) is not None:
        return say(refused, verbose)
    try:
        results = launch(_exercise_rank, world_size, fn, timeout_s=60)
    except LaunchError as error:
        busy = not_started(str(error))
        return say(Check(False, "slow", busy) if busy else Check(
            False, "hang", "Your function did not finish on every rank: "
            + str(error).splitlines()[0] + ". Every rank must call the same collectives in the "
            "same order."), verbose)
    check = _judge(results[0], world_size)
    check = with_hint(check, ROW_HINTS)
    return say(check, verbose)


ROW_HINTS = Hints(
    concept="each rank's slice of the input times its slice of the weight is a partial sum of "
            "the whole output; the ranks' partial sums must be added (inside autograd, so the "
            "weights get their gradients), and the bias belongs to the sum, once.",
    code="return tp.reduce_from_tp(F.linear(x_shard, weight_shard), group) + bias")
BLOCK_HINTS = Hints(
    concept="count the all-reduces of one block (attention and MLP, forward and backward) and "
            "what a ring all-reduce sends per rank for one b x s x h activation in bf16.",
    code="4 all-reduces x 2(t-1)/t x S bytes, S = b x s x h x 2 bytes.",
    exercise=2, kind="formula")
RING_HINTS = Hints(
    concept="a chunk's matmul time grows with its T/t tokens, and so does its message's "
            "transfer time; only the message's fixed latency alpha does not, so the matmul "
            "covers the message from the T where the growing difference pays for alpha.",
    code="2 (T/t) h_in (h_out/t) / (mfu x peak) = alpha + (T/t) h_in x 2 bytes / effective "
         "bandwidth, solved for T: T = t alpha / (h_in (2 (h_out/t) / (mfu x peak) - 2 / "
         "bandwidth)), mfu x peak the constant-MFU rule the question states "
         "(cluster.mfu).", exercise=3, kind="formula")
HINTS = {1: ROW_HINTS, 2: BLOCK_HINTS, 3: RING_HINTS}


def show_solution(exercise=1):
    """Print the code (exercise 1) or the formula (2, 3)."""
    show(HINTS, exercise)


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
    if "shape" in r0 and isinstance(r0["shape"], str):
        return Check(False, "not a tensor", f"Your function returned {r0['shape']}, not a "
                     "tensor: return the layer's output (4, 6).")
    if "shape" in r0:
        return Check(False, "shape", f"The output has shape {r0['shape']}, the full layer's is "
                     "(4, 6). A row-parallel linear gives every rank the whole output: sum the "
                     "partial results, do not concatenate them (that would be all_gather, for "
                     "column-parallel outputs).")
    y, expected, bias, partial = r0["y"], r0["expected"], r0["bias"], r0["partial"]
    if not y.is_floating_point():
        return Check(False, "dtype", f"The output has dtype {r0['y_dtype']}; the layer's is "
                     "float32: keep the values floating point.")
    y = y.float()
    if torch.allclose(y, expected, atol=1e-5):
        if "grad_error" in r0:
            return Check(False, "gradient", "The output is right but backward fails "
                         f"({r0['grad_error'][:80]}): an in-place all-reduce on a tensor "
                         "autograd keeps; use reduce_from_tp (g: all-reduce forward, identity "
                         "backward).")
        if r0.get("grad_ok") is None:
            return Check(False, "detached", "The output is right but detached from autograd: "
                         "the weight shard gets no gradient (a .detach(), torch.no_grad or a "
                         "collective outside autograd). Use reduce_from_tp, which all-reduces "
                         "forward and passes the gradient backward.")
        if r0.get("grad_ok") is False:
            return Check(False, "gradient", "The output is right but the weight gradient is "
                         "not (missing or different): keep the all-reduce inside the autograd "
                         "graph (reduce_from_tp: all-reduce forward, identity backward).")
        return Check(True, "", "Correct: each rank multiplies its slice of the input features "
                     "by its slice of the weight, one all-reduce sums the partial results, and "
                     f"the bias is added once, after it. Communication: {', '.join(r0['calls'])}.")
    if torch.allclose(y, partial + bias, atol=1e-5) or torch.allclose(y, partial, atol=1e-5):
        return Check(False, "no sum", "Each rank returns only its own partial sum X_i A_i^T: "
                     "the results of the ranks are never added. Sum them with one all-reduce "
                     "over the group (e.g. reduce_from_tp(y, group)) before adding the bias.")
    if torch.allclose(y, (expected - bias) / world_size + bias, atol=1e-5):
        return Check(False, "averaged", f"The partial sums are averaged ({world_size} times "
                     "too small): the ranks' partial products add up to the output, so sum "
                     "them (op='sum'), do not average.")
    if torch.allclose(y, expected + (world_size - 1) * bias, atol=1e-5):
        return Check(False, "bias", f"The bias is counted {world_size} times: every rank added "
                     "it before the all-reduce summed the ranks. Add the bias after the "
                     "all-reduce, once.")
    return Check(False, "wrong", "The output differs from the full layer's (max difference "
                 f"{(y - expected).abs().max():.3g}), and not by a missing sum, an average or a "
                 "repeated bias.")


BLOCK = dict(batch=1, seq=4096, hidden=8192, tp=8)   # Llama 3 70B's width, one node of TP


def check_block_bytes(answer, batch=BLOCK["batch"], seq=BLOCK["seq"], hidden=BLOCK["hidden"],
                      tp=BLOCK["tp"], verbose=True):
    """Bytes one GPU sends per transformer block and micro-batch, forward + backward, bf16,
    without sequence parallelism (ring all-reduces)."""
    t, size = tp, batch * seq * hidden * 2          # S: one b x s x h bf16 activation
    expected = block_wire_bytes(batch, seq, hidden, tp)
    ring = 2 * (t - 1) / t * size
    mistakes = [
        Mistake(2 * ring, "half the calls", "that counts 2 all-reduces; a block runs 4 (g "
                "after attention and after the MLP in forward, f before them in backward)"),
        Mistake(ring, "one call", "that is one all-reduce; a block runs 4 (2 forward, 2 "
                "backward)"),
        Mistake(4 * size, "payload", "that counts S per all-reduce, the payload; a ring "
                "all-reduce sends a little under twice that per rank"),
        Mistake(4 * (t - 1) / t * size, "one phase", "a ring all-reduce sends each byte "
                "twice, once in reduce-scatter and once in all-gather"),
        Mistake(expected / 2, "values, not bytes", "that counts values; each bf16 value is 2 "
                "bytes"),
        Mistake(4 * 2 * size, "factor (t-1)/t", "that sends 2 S per all-reduce; a rank never "
                "sends the chunk it ends up owning, so a ring sends (t-1)/t of that"),
        Mistake(2 * expected, "fp32", "that counts 4 bytes per value; the activations are "
                "bf16, 2 bytes each"),
        Mistake(expected / t, "divided by t", f"that divides by t = {t} once more; the "
                "activation S is whole on every rank in TP without SP"),
    ]
    return check_number(answer, expected, what=f"bytes one GPU sends per block (b={batch}, "
                        f"s={seq}, h={hidden}, t={t}, bf16)", unit="bytes", mistakes=mistakes,
                        verbose=verbose, hints=BLOCK_HINTS,
                        explain="Every layer of the model sends this, on the critical path.")


RING = dict(in_features=8192, out_features=28672, tp=8, cluster="8xH100-NVLink")


def check_break_even_tokens(answer, in_features=RING["in_features"],
                            out_features=RING["out_features"], tp=RING["tp"],
                            cluster=RING["cluster"], verbose=True):
    """Tokens per micro-batch at which one chunk's matmul (colwise, SP, bf16) lasts as long as
    the ring message carrying the chunk (theory.async_tp.break_even_tokens), the matmul at the
    in-step GEMM rate (step_rate.in_step_gemm_rate: the planner's and the run clock's)."""
    c = hardware.cluster(cluster)
    link, peak, rate = c.link_for(range(tp)), c.gpu.flops("bf16"), in_step_gemm_rate(c.gpu)
    expected = break_even_tokens(in_features, out_features, tp, cluster=cluster)

    def solve(flops_per_s=rate, bytes_per_value=2, bandwidth=link.effective_bandwidth,
              outputs=out_features / tp):
        per_token = in_features * (2 * outputs / flops_per_s - bytes_per_value / bandwidth)
        return tp * link.latency / per_token
    mistakes = [
        Mistake(0.0, "no latency", "without the latency alpha both times grow in proportion to "
                "T, so no T is special: it is alpha, paid per message, that the matmul covers"),
        Mistake(solve(flops_per_s=peak), "peak", f"that runs the matmul at peak; inside a step "
                f"a GEMM runs at {rate / peak:.0%} of it (in_step_gemm_rate)"),
        Mistake(solve(flops_per_s=peak * c.mfu), "constant MFU", f"that is the constant-MFU "
                f"rule (cluster.mfu = {c.mfu}); the lab prices a GEMM at in_step_gemm_rate"),
        Mistake(solve(bytes_per_value=4), "fp32", "that sends 4 bytes per value; bf16 is 2"),
        Mistake(solve(bandwidth=link.bandwidth), "line rate", f"that uses the line rate; the "
                f"link delivers {link.efficiency:.0%} of it (effective_bandwidth)"),
        Mistake(solve(outputs=out_features), "all outputs", "a rank multiplies only its h_out/t "
                "output features (colwise)"),
        Mistake(solve(flops_per_s=2 * rate), "FLOPs per multiply-add", "a "
                "multiply-add is 2 FLOPs: a matmul of m x k by k x n costs 2 m k n"),
        Mistake(expected / tp, "chunk = T", f"that solves for a chunk's tokens, T/t; the "
                f"question asks for the micro-batch's T, t = {tp} chunks"),
    ]
    return check_number(answer, expected, what=f"tokens per micro-batch at which the ring hides "
                        f"({in_features}->{out_features}, t={tp}, {c.gpu.name} over {link.name})",
                        unit="tokens", mistakes=mistakes, verbose=verbose, hints=RING_HINTS,
                        explain="Above it the whole all-gather hides under the chunk matmuls.")
