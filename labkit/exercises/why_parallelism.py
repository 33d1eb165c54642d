"""Lesson 00's exercises: a broadcast written by hand with send and recv on 4 ranks, and the
model states of Llama 3 8B.

`check_broadcast(fn)` runs the learner's `fn(ctx, tensor)` on every rank under `labkit.launch`,
each rank with different data: afterwards every rank must hold rank 0's tensor (returned, or
written into `tensor`), moved with `ctx.comm.send` / `ctx.comm.recv` only. The feedback names
what went wrong: nothing received, rank 0's data overwritten, a collective used instead, a hang
(every rank waiting in recv), or an error. The number exercises compare with
`theory.memory.model_state_bytes` (mixed-precision Adam: 16 bytes per parameter).
"""
import math

import torch

from ..theory import catalog, hardware, memory as tm
from . import (_answer_value, Check, Hints, Mistake, check_number, not_a_function, not_started, say,
               show, with_hint)

MODEL, GPU = "llama-3-8b", "H100"
HINT = ("Hint: on rank 0, ctx.comm.send(tensor, dst) to every other rank dst; on every other "
        "rank, ctx.comm.recv(tensor, 0) (it writes into tensor); then return tensor.")


def _data(rank, numel=6):
    return torch.arange(numel, dtype=torch.float32) + 10.0 * (rank + 1)


def _run_user(ctx, fn):
    tensor = _data(ctx.rank)
    out = fn(ctx, tensor)
    got = out if isinstance(out, torch.Tensor) else tensor
    records = ctx.comm.records
    return dict(rank=ctx.rank, got=got.detach().reshape(-1).to(torch.float32, copy=True),
                sent=sum(rec.bytes for rec in records if rec.op == "send"),
                others=sorted({rec.op for rec in records if rec.op not in ("send", "recv")}))


def check_broadcast(fn, world_size=4, timeout_s=20.0, verbose=True):
    """Run `fn(ctx, tensor)` on `world_size` ranks: each must end with rank 0's tensor."""
    from ..runtime.launch import LaunchError, launch
    if (refused := not_a_function(fn, "fn(ctx, tensor)")) is not None:
        return say(refused, verbose)
    try:
        results = launch(_run_user, world_size, fn, timeout_s=timeout_s)
    except LaunchError as error:
        check = _failed(str(error))
    else:
        check = _judge(results)
    check = with_hint(check, BROADCAST_HINTS)
    return say(check, verbose)


def _judge(results):
    n, want = len(results), _data(0)
    for res in results:
        r, got = res["rank"], res["got"]
        if got.shape != want.shape:
            return Check(False, "shape", f"Rank {r} holds {got.numel()} values, rank 0's "
                         f"tensor has {want.numel()}: receive into a tensor of the same shape.")
        if torch.equal(got, want):
            continue
        if r == 0:
            return Check(False, "source changed", "Rank 0's own tensor changed: rank 0 only "
                         f"sends.")
        if torch.equal(got, _data(r)):
            return Check(False, "not received", f"Rank {r} still holds its own data: it "
                         f"received nothing (or received into another tensor).")
        return Check(False, "wrong value", f"Rank {r} holds {got.tolist()}, rank 0 sent "
                     f"{want.tolist()}.")
    used = sorted({op for res in results for op in res["others"]})
    if used:
        return Check(False, "collective", f"Every rank holds rank 0's data, but with "
                     f"{', '.join(used)}: write it with ctx.comm.send and ctx.comm.recv only.")
    root = results[0]["sent"]
    return Check(True, "", f"Correct: all {n} ranks hold rank 0's tensor. Rank 0 sent "
                 f"{root} bytes, {n - 1} x the tensor's {want.nbytes}: the root's link carries "
                 "N-1 copies. Lesson 01's ring spreads that load over every link.")


def _failed(text):
    if (busy := not_started(text)) is not None:
        return Check(False, "slow", busy)
    if "NotImplementedError" in text:
        return Check(False, "not written", "NOT WRITTEN YET: your function raised "
                     "NotImplementedError. Hint: only rank 0 sends; every other rank receives, "
                     "once, from rank 0.")
    if "timed out" in text or "closed by peer" in text or "reset by peer" in text:
        return Check(False, "hang", "HANG: some rank waited for a message nobody sent (a recv "
                     "on rank 0, or a recv from a rank that never sends to it). Only rank 0 "
                     f"sends; each other rank receives once, from rank 0.")
    last = [line for line in text.splitlines() if line.strip()][-1].strip()
    return Check(False, "raised", f"YOUR CODE RAISED on a rank: {last}.")


def _params():
    return catalog.model(MODEL).param_count()


BROADCAST_HINTS = Hints(
    concept="only rank 0 has the data: it sends, every other rank receives, once.",
    code=HINT.removeprefix("Hint: "), exercise=1)
STATES_HINTS = Hints(
    concept="mixed-precision Adam keeps, per parameter, a bf16 weight, a bf16 gradient and an "
            "fp32 master copy, momentum and variance; plain data parallelism keeps all of it "
            "on every GPU.",
    code=lambda: f"(2 + 2 + 4 + 4 + 4) = 16 bytes x {_params():,} parameters / 1e9 = "
                 f"{16 * _params() / 1e9:.1f} GB.", exercise=2, kind="formula")
ZERO3_HINTS = Hints(
    concept="ZeRO-3 splits all 16 bytes per parameter evenly over the N GPUs; find the "
            "smallest whole N whose share fits one H100's memory (as the driver reports it).",
    code=lambda: f"the smallest whole N with 16 x {_params():,} / N <= "
                 f"{hardware.gpu(GPU).memory_bytes:,.0f} bytes: N = ceil(16 x params / "
                 "memory).", exercise=3, kind="formula")
HINTS = {1: BROADCAST_HINTS, 2: STATES_HINTS, 3: ZERO3_HINTS}


def show_solution(exercise=1):
    """Print the code (exercise 1) or the formula (2, 3) of one of this lesson's exercises."""
    show(HINTS, exercise)


def check_gb_no_zero(answer, verbose=True):
    """GB of model states per GPU for Llama 3 8B with plain data parallelism."""
    psi = _params()
    expected = tm.model_state_bytes(psi, zero_stage=0)["total"] / 1e9
    mistakes = [
        Mistake(2 * psi / 1e9, "weights only", "that is 2 bytes per parameter, the bf16 "
                "weights alone; training also keeps gradients and Adam's state"),
        Mistake(16 * psi / 8 / 1e9, "divided by GPUs", "that divides the states by 8 GPUs; "
                "plain data parallelism divides nothing, each GPU holds a whole replica"),
        Mistake(4 * psi / 1e9, "no optimizer", "that is weights + gradients (2 + 2 bytes); add "
                "the 12 bytes of fp32 master copy, momentum and variance"),
        Mistake(12 * psi / 1e9, "optimizer only", "that is the optimizer state alone; add the "
                "bf16 weights and gradients (2 + 2 bytes)"),
        Mistake(12 * psi / 1e9, "no master copy", "that forgets Adam's fp32 master copy of "
                "the weights (4 bytes): 2 + 2 + 4 + 4 = 12 bytes per parameter"),
        Mistake(18 * psi / 1e9, "fp32 gradients", "that keeps fp32 gradients (4 bytes, 18 per "
                "parameter); this lesson counts bf16 gradients, as the ZeRO paper does"),
    ]
    return check_number(answer, expected, what="GB of model states per GPU (Llama 3 8B, plain "
                        "data parallelism)", unit="GB", mistakes=mistakes, verbose=verbose,
                        hints=STATES_HINTS,
                        explain="Each replica holds it whole: more GPUs do not make it fit an "
                        f"{hardware.gpu(GPU).memory_bytes / 1e9:.0f} GB H100.")


def fewest_gpus_zero3(params=None, gpu=GPU):
    """The fewest GPUs whose memory holds the model states split N ways (ZeRO-3)."""
    psi, cap = params or _params(), hardware.gpu(gpu).memory_bytes
    return next(n for n in range(1, 4097)
                if tm.model_state_bytes(psi, zero_stage=3, world_size=n)["total"] <= cap)


def check_fewest_gpus_zero3(answer, verbose=True):
    """The fewest H100s that hold Llama 3 8B's model states with ZeRO-3."""
    expected = fewest_gpus_zero3()
    psi, cap = _params(), hardware.gpu(GPU).memory_bytes
    value = _answer_value(answer)
    if value is not None and value > 0 and not float(value).is_integer() \
            and abs(value - 16 * psi / cap) < 0.15:
        return say(Check(False, "not whole", (
            f"Not quite: {value:g} is the share before rounding; GPUs come whole, and "
            f"{math.floor(value)} would not hold it: round up. "
            f"{ZERO3_HINTS.after_failure()}")), verbose)
    mistakes = []
    if expected > 1:
        mistakes = [
            Mistake(expected - 1, "does not fit", f"on {expected - 1} GPU(s) each holds "
                    f"{16 * psi / (expected - 1) / 1e9:.0f} GB, more than an H100's "
                    f"{cap / 1e9:.0f} GB: rounded down instead of up"),
            Mistake(math.ceil(2 * psi / cap), "weights only", "that fits the bf16 weights "
                    "alone (2 bytes per parameter); training keeps 16 bytes per parameter"),
        ]
    mistakes.append(Mistake(expected + 1, "one too many", f"{expected} already hold it: "
                            f"{16 * psi / expected / 1e9:.0f} GB each, under {cap / 1e9:.0f} "
                            "GB"))
    return check_number(answer, expected, what="the fewest H100s with ZeRO-3", unit="GPUs",
                        exact=True, mistakes=mistakes, verbose=verbose, hints=ZERO3_HINTS,
                        explain="Activations need room too, so a real run uses more.")
