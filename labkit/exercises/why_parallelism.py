"""Lesson 00's exercises: a first collective on 4 ranks, and the model states of Llama 3 8B.

`check_first_collective(fn)` runs the learner's `fn(ctx)` on every rank under `labkit.launch`:
each rank contributes its rank number and must get back what `all_reduce` gives, the sum over
ranks. The feedback names what went wrong: nothing reduced, averaged, a constant contributed, a
collective only some ranks call (a hang), or an error. The number exercises compare with
`theory.memory.model_state_bytes` (mixed-precision Adam: 16 bytes per parameter).
"""
from ..theory import catalog, hardware, memory as tm
from . import Check, Mistake, check_number, say

MODEL, GPU = "llama-3-8b", "H100"
HINT = ("Hint: make a one-element tensor holding float(ctx.rank), call "
        "ctx.comm.all_reduce(t) on every rank (it sums in place), and return t.item().")


def first_collective(ctx):
    """One answer: every rank contributes its rank; all_reduce leaves the sum on every rank."""
    import torch
    t = torch.tensor([float(ctx.rank)])
    ctx.comm.all_reduce(t)
    return t.item()


def _run_user(ctx, fn):
    out = fn(ctx)
    value = out.item() if hasattr(out, "item") and getattr(out, "numel", lambda: 1)() == 1 \
        else out
    return dict(rank=ctx.rank, value=value, ops=[rec.op for rec in ctx.comm.records])


def check_first_collective(fn, world_size=4, timeout_s=20.0, verbose=True):
    """Run `fn(ctx)` on `world_size` ranks: each must return sum(range(world_size))."""
    from ..runtime.launch import LaunchError, launch
    try:
        results = launch(_run_user, world_size, fn, timeout_s=timeout_s)
    except LaunchError as error:
        return say(_failed(str(error)), verbose)
    return say(_judge(results, world_size), verbose)


def _judge(results, n):
    want = float(sum(range(n)))
    values = [r["value"] for r in results]
    if any(v is None for v in values):
        return Check(False, "no value", "Your function returned None on some rank: return the "
                     f"reduced value (e.g. t.item()), not the result of a print. {HINT}")
    try:
        got = [float(v) for v in values]
    except (TypeError, ValueError):
        return Check(False, "not a number", f"Return one number per rank, got {values[0]!r} on "
                     f"rank 0. {HINT}")
    if all(g == want for g in got):
        ops = sorted({op for r in results for op in r["ops"]})
        return Check(True, "", f"Correct: every rank holds 0 + 1 + ... + {n - 1} = {want:g} "
                     f"(collectives called: {', '.join(ops)}). Every rank called the same "
                     "collective; the sum came back to all of them.")
    if got == [float(r) for r in range(n)]:
        return Check(False, "not reduced", "Each rank returned its own rank: nothing was "
                     f"reduced. {HINT}")
    if all(g == want / n for g in got):
        return Check(False, "averaged", f"Every rank holds {want / n:g}, the mean: all_reduce "
                     "sums by default; do not divide by the number of ranks here.")
    if all(g == n for g in got):
        return Check(False, "constant", f"Every rank holds {n:g}: each contributed 1, not its "
                     "rank number.")
    table = ", ".join(f"rank {r}: {g:g}" for r, g in enumerate(got))
    return Check(False, "wrong value", f"Expected {want:g} on every rank, got {table}. {HINT}")


def _failed(text):
    if "NotImplementedError" in text:
        return Check(False, "not written", f"NOT WRITTEN YET: your function raised "
                     f"NotImplementedError. {HINT}")
    if "timed out" in text or "closed by peer" in text or "reset by peer" in text:
        return Check(False, "hang", "HANG: some ranks waited in a collective that the others "
                     "never called. A collective must be called by every rank of the group (no "
                     f"collective under `if ctx.rank == 0`). {HINT}")
    last = [line for line in text.splitlines() if line.strip()][-1].strip()
    return Check(False, "raised", f"YOUR CODE RAISED on a rank: {last}. {HINT}")


def _params():
    return catalog.model(MODEL).param_count()


def check_gb_no_zero(answer, verbose=True):
    """GB of model states per GPU for Llama 3 8B with plain data parallelism."""
    psi = _params()
    expected = tm.model_state_bytes(psi, zero_stage=0)["total"] / 1e9
    mistakes = [
        Mistake(2 * psi / 1e9, "weights only", "that is 2 bytes per parameter: the bf16 weights "
                "alone (training also keeps gradients and Adam's state), or all 16 bytes "
                "divided by 8 GPUs (plain data parallelism divides nothing)"),
        Mistake(4 * psi / 1e9, "no optimizer", "that is weights + gradients (2 + 2 bytes); add "
                "the 12 bytes of fp32 master copy, momentum and variance"),
        Mistake(12 * psi / 1e9, "optimizer only", "that is the optimizer state alone; add the "
                "bf16 weights and gradients (2 + 2 bytes)"),
    ]
    return check_number(answer, expected, what="GB of model states per GPU (Llama 3 8B, plain "
                        "data parallelism)", unit="GB", mistakes=mistakes, verbose=verbose,
                        hint=f"16 bytes per parameter x {psi / 1e9:.2f} B parameters, in GB.",
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
    cap = hardware.gpu(GPU).memory_bytes
    mistakes = [Mistake(expected - 1, "does not fit", f"on {expected - 1} GPU(s) each holds "
                        f"{16 * _params() / (expected - 1) / 1e9:.0f} GB, more than an H100's "
                        f"{cap / 1e9:.0f} GB")] if expected > 1 else []
    return check_number(answer, expected, what="the fewest H100s with ZeRO-3", unit="GPUs",
                        exact=True, mistakes=mistakes, verbose=verbose,
                        hint=f"the smallest whole N with 16 x {_params() / 1e9:.2f}e9 / N <= "
                             f"{cap / 1e9:.1f}e9 bytes (an H100 as the driver reports it).",
                        explain="Activations need room too, so a real run uses more.")
