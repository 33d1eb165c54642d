"""Lesson 04's exercises: a ZeRO-2 gradient shard on 4 ranks, and the bytes of model states
per GPU under a ZeRO stage.

`check_gradient_shard(fn)` runs the learner's `fn(ctx, grad)` on 4 ranks, each with its own
full gradient; it must return this rank's 1/N slice of the gradient averaged over the ranks
(what ZeRO-2 keeps), and moving no more bytes than reduce-scatter's (N-1)/N x S per rank. It
says in words what is wrong: summed, the whole gradient kept, an all-reduce sliced afterwards
(right values, twice the bytes and for a moment the whole gradient), another rank's slice,
nothing reduced. The first wrong answer gets a hint, later ones (or `show_solution()`) the code.

`check_stage_memory_answer(answer, params, world_size, stage)` compares the learner's number
with `theory.memory.model_state_bytes` and, when it is wrong, names the mistake it matches
(the baseline, another stage, a forgotten master copy, fp32 weights, GB instead of bytes).
"""
import torch

from ..theory import memory as tm
from ..theory.time import wire_bytes_per_rank
from . import (Check, Hints, Mistake, check_number, not_a_function, not_started, say, show,
               with_hint)

SHARD_HINTS = Hints(
    concept="one collective both sums over the ranks and leaves each rank only its 1/N slice, "
            "sending (N-1)/N x S bytes; and each rank's loss is a mean over its part of the "
            "batch, so the sum must become an average.",
    code="mine = ctx.comm.reduce_scatter(grad)  (sums over the ranks; rank r keeps slice r of "
         "dim 0), then return mine / ctx.world_size.")


STAGE_HINTS = Hints(
    concept="list the model states per parameter (weight, gradient, optimizer state, in "
            "bytes) and ask, for each, whether this stage keeps it whole on every GPU or splits "
            "it over the N GPUs.",
    code="stage 1: (2 + 2 + 12/N) Psi; stage 2: (2 + (2 + 12)/N) Psi; stage 3: 16 Psi / N "
         "(mixed-precision Adam: 2 + 2 + 12 bytes per parameter).", exercise=2, kind="formula")
ROOFLINE_HINTS = Hints(
    concept="a step on B tokens per GPU computes 6 Psi B FLOPs and FSDP sends a fixed number "
            "of bytes per parameter; the communication can hide once the compute takes as long "
            "as the transfer.",
    code="6 Psi B / peak = 3 (N-1)/N x 2 Psi / effective bandwidth, so B = peak / bandwidth x "
         "3 (N-1)/N x 2 / 6 (Psi cancels).", exercise=3, kind="formula")
HINTS = {1: SHARD_HINTS, 2: STAGE_HINTS, 3: ROOFLINE_HINTS}


def show_solution(exercise=1):
    """Print the code (exercise 1, a ZeRO-2 gradient shard) or the formula (2, 3)."""
    show(HINTS, exercise)


def _shard_input(rank, numel):
    """Distinct, exactly summable values per rank."""
    return torch.arange(numel, dtype=torch.float32) + 64.0 * rank


def _run_shard(ctx, fn, numel):
    grad = _shard_input(ctx.rank, numel)
    out = fn(ctx, grad.clone())
    sent = {rec.op for rec in ctx.comm.records}
    wire = sum(rec.wire_bytes_per_rank for rec in ctx.comm.records)
    return dict(rank=ctx.rank, out=out.detach().clone() if isinstance(out, torch.Tensor)
                else out, ops=sorted(sent), wire_bytes=wire, grad_bytes=grad.nbytes)


def check_gradient_shard(fn, world_size=4, numel=16, timeout_s=20.0, verbose=True):
    """Run `fn(ctx, grad)` on `world_size` ranks; each must return its averaged shard."""
    from ..runtime.launch import LaunchError, launch
    if (refused := not_a_function(fn, "fn(ctx, grad)")) is not None:
        return say(refused, verbose)
    try:
        results = launch(_run_shard, world_size, fn, numel, timeout_s=timeout_s)
    except LaunchError as error:
        text = str(error)
        if "NotImplementedError" in text:
            return say(Check(False, "not written", "NOT WRITTEN YET: your function raised "
                             f"NotImplementedError. Hint: {SHARD_HINTS.concept}"), verbose)
        if (busy := not_started(text)) is not None:
            return say(Check(False, "slow", busy), verbose)
        if "timed out" in text:
            return say(Check(False, "hang", "HANG: the ranks did not call the same collectives. "
                             f"{SHARD_HINTS.after_failure()}"), verbose)
        last = [line for line in text.splitlines() if line.strip()][-1].strip()
        return say(Check(False, "raised", f"YOUR CODE RAISED on a rank: {last}. "
                         f"{SHARD_HINTS.after_failure()}"), verbose)
    check = _judge_shard(results, world_size, numel)
    check = with_hint(check, SHARD_HINTS)
    return say(check, verbose)


def _judge_shard(results, n, numel):
    mean = sum(_shard_input(r, numel) for r in range(n)) / n
    shards = list(mean.chunk(n))
    for res in results:
        out, r = res["out"], res["rank"]
        if not isinstance(out, torch.Tensor):
            return Check(False, "not a tensor", f"Rank {r} returned {type(out).__name__}, not "
                         f"a tensor.")
        out = out.reshape(-1).float()
        if out.numel() == numel:
            if torch.allclose(out, mean):
                return Check(False, "whole gradient", (
                    "Every rank holds the whole averaged gradient: that is DP's all-reduce. "
                    f"ZeRO-2 keeps only its 1/{n} slice ({numel // n} of {numel} values), and "
                    "a reduce-scatter sends half the bytes of an all-reduce."))
            if torch.allclose(out, _shard_input(r, numel)):
                return Check(False, "not reduced", f"Rank {r} returned its own gradient, "
                             "unreduced.")
            return Check(False, "wrong size", f"Rank {r} returned {numel} values: keep only "
                         f"its slice of {numel // n}.")
        if out.numel() != numel // n:
            return Check(False, "wrong size", f"Rank {r} returned {out.numel()} values, its "
                         f"slice has {numel // n} ({numel} / {n} ranks).")
        if torch.allclose(out, shards[r]):
            continue
        if torch.allclose(out, n * shards[r]):
            return Check(False, "summed", f"Rank {r}'s slice is the sum over the ranks, {n}x "
                         "the average: each rank's loss is already a mean over its shard of "
                         f"the batch; divide the sum by ctx.world_size = {n}.")
        if torch.allclose(out, _shard_input(r, numel).chunk(n)[r]):
            return Check(False, "not reduced", f"Rank {r} returned its own slice, unreduced: "
                         "the other ranks' gradients for it never arrived.")
        owner = [i for i in range(n) if torch.allclose(out, shards[i])]
        if owner:
            return Check(False, "wrong slice", f"Rank {r} holds slice {owner[0]}: rank r "
                         "keeps slice r of dim 0 (what reduce_scatter gives it).")
        return Check(False, "wrong value", f"Rank {r}'s slice is wrong.")
    ops = sorted({op for res in results for op in res["ops"]})
    needed = wire_bytes_per_rank("reduce_scatter", results[0]["grad_bytes"], n)
    worst = max(results, key=lambda res: res["wire_bytes"])
    if worst["wire_bytes"] > needed * (1 + 1e-9):
        via = f"{', '.join(ops)}, then a slice" if "all_reduce" in ops else ", ".join(ops)
        return Check(False, "too many bytes", (
            f"RIGHT VALUES, TOO MANY BYTES: rank {worst['rank']} moved "
            f"{worst['wire_bytes']:.0f} bytes ({via}), where the least any collective can move "
            f"for this shard is reduce-scatter's (N-1)/N x S = {n - 1}/{n} x "
            f"{results[0]['grad_bytes']} = {needed:.0f} bytes. "
            + ("An all-reduce sends every byte twice (reduce-scatter, then all-gather) and "
               "leaves each rank the whole averaged gradient for a moment, the memory ZeRO-2 "
               "saves; the slice you keep was already on this rank after the first half."
               if "all_reduce" in ops else "")))
    return Check(True, "", f"Correct: each of the {n} ranks keeps its averaged 1/{n} slice of "
                 f"the gradient ({numel // n} of {numel} values; collectives: "
                 f"{', '.join(ops)}). The optimizer then steps only that slice.")


def stage_memory_answer(params, world_size, stage, mixed_precision=True):
    """The expected model-state bytes per GPU (theory.memory.model_state_bytes, Adam)."""
    return tm.model_state_bytes(params, mixed_precision=mixed_precision, zero_stage=stage,
                                world_size=world_size)["total"]


def check_stage_memory_answer(answer, params, world_size, stage=2, mixed_precision=True,
                              verbose=True):
    """Say in words whether `answer` (bytes of model states per GPU) is right; never raises.

    Right means within 1% of theory.memory.model_state_bytes; a wrong answer that matches the
    baseline, another stage, a forgotten master copy or fp32 weights is named.
    """
    n = world_size
    w, k = (2, 12) if mixed_precision else (4, 8)
    expected = stage_memory_answer(params, world_size, stage, mixed_precision)
    full = stage_memory_answer(params, n, stage, mixed_precision)
    layouts = {   # name: (what the number is, its bytes)
        "baseline": ("the baseline without ZeRO (nothing divided by N)", (2 * w + k) * params),
        "stage 1": ("stage 1 (only the optimizer state divided by N)", (2 * w + k / n) * params),
        "stage 2": ("stage 2 (optimizer state and gradients divided by N)",
                    (w + (w + k) / n) * params),
        "stage 3": ("stage 3 (the weights divided by N as well)", (2 * w + k) * params / n),
        "no master copy": ("this stage without the fp32 master copy (K = 8 instead of 12)",
                           full - 4 * params / (n if stage >= 1 else 1)),
        "fp32 weights": ("this stage with the weights in fp32 (4 bytes, not 2)",
                         full + (4 - w) * params / (n if stage == 3 else 1)),
    }
    mistakes = [Mistake(nbytes, "another layout", f"that is {name}. Which states does stage "
                        f"{stage} shard, and which does every GPU keep whole?", short)
                for short, (name, nbytes) in layouts.items() if short != f"stage {stage}"]
    return check_number(answer, expected, what=f"bytes of model states per GPU, ZeRO stage "
                        f"{stage} on N = {n}", unit="bytes", mistakes=mistakes, verbose=verbose,
                        hints=STAGE_HINTS,
                        explain=f"That is {expected / params:.3g} bytes per parameter.")


ROOFLINE = dict(gpus=64, gpu="H100", link="InfiniBand NDR")   # 400 Gb/s per GPU


def check_fsdp_critical_batch(answer, gpus=ROOFLINE["gpus"], gpu=ROOFLINE["gpu"],
                              link=ROOFLINE["link"], verbose=True):
    """The smallest tokens per GPU at which FSDP (ZeRO-3) on `gpus` GPUs over `link` can be
    compute-bound (at peak bf16, the link at the catalog's effective bandwidth)."""
    from ..theory import hardware
    from ..theory import roofline
    expected = roofline.critical_batch("fsdp", gpus, gpu, link)
    n, ln = gpus, hardware.link(link)
    mistakes = [
        Mistake(roofline.critical_batch("dp", gpus, gpu, link), "DP's bytes",
                "that is DP's batch: it all-reduces 2(N-1)/N x Psi bytes, FSDP sends 3(N-1)/N x "
                "Psi (all-gather forward, all-gather backward, reduce-scatter)"),
        Mistake(roofline.critical_batch("fsdp", gpus, gpu, link, effective=False), "line rate",
                f"that uses the line rate {ln.bandwidth / 1e9:.0f} GB/s; the lab's link model "
                f"delivers {ln.efficiency:.0%} of it ({ln.effective_bandwidth / 1e9:.0f} GB/s)"),
        Mistake(expected / 8, "bits", "that reads 400 Gb/s as 400 GB/s: 8 bits to a byte"),
        Mistake(expected / 2, "bytes per value", "weights and gradients travel in bf16, 2 "
                "bytes each, not 1"),
        Mistake(roofline.critical_batch("dp", gpus, gpu, link), "one all-gather",
                "that gathers the weights once; FSDP gathers them in forward and again in "
                "backward (it freed them in between), besides the reduce-scatter"),
        Mistake(3 * expected, "forward only", "that counts 2 Psi FLOPs per token, the forward "
                "alone; a training step computes 6 Psi (backward twice the forward)"),
        Mistake(expected / 0.5, "at mfu", "that runs the GPU at an mfu of 0.5; the question "
                "asks at peak, where the batch is smallest"),
    ]
    return check_number(
        answer, expected, unit="tokens", tolerance=0.02,   # dropping (N-1)/N = 63/64 is fine
        mistakes=mistakes, verbose=verbose,
        what=f"the smallest per-GPU batch at which FSDP on {n} {gpu}s over {link} can be "
             "compute-bound",
        hints=ROOFLINE_HINTS,
        explain="Psi cancels: the answer holds for any model size. Below it, FSDP waits for "
                "its link however well it overlaps.")
