"""Lesson 07's exercise: fix a data-parallel gradient sync that sums instead of averaging.

`check_gradient_sync(sync_fn)` trains a small nn.Sequential on 2 ranks, each on its half of
every batch; after each backward it calls the learner's `sync_fn(ctx, model)`, which must leave
every rank holding the gradient of the *full* batch's mean loss. It compares the parameters
with one device trained on the whole batch and says, in words, what went wrong: not written
yet, a hang, replicas that drift apart (no sync), updates N times too large (summed, not
averaged), or some other difference. It answers with a `Check`; it never raises. The first
wrong answer gets a hint, later ones (or `show_solution()`) the code.
`check_mfu_answer(answer)` checks a number: the MFU of a measured throughput, against
`theory.time.training_flops` (6 x params per token) over GPUs x the dense bf16 peak, names
the wrong peaks and FLOP counts, and accepts inputs rounded as a learner would (8e9 parameters,
1 PFLOP/s for the H100's 989 TFLOP/s), saying so.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..theory import catalog, hardware
from ..theory.time import training_flops
from . import (Check, Hints, Mistake, Rounding, check_number, not_a_function, not_started, say,
               show, with_hint)

DIMS, BATCH, LR, STEPS = (8, 16, 4), 8, 0.1, 3


def exercise_model():
    """The same small MLP on every rank (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIMS[0], DIMS[1]), nn.GELU(), nn.Linear(DIMS[1], DIMS[2]))


def exercise_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIMS[0], generator=g), torch.randn(BATCH, DIMS[2], generator=g)


def sum_gradients(ctx, model):
    """The bug of the lesson: every rank adds up the others' gradients and stops there."""
    for p in model.parameters():
        ctx.comm.all_reduce(p.grad, tag="gradients")


def average_gradients(ctx, model):
    """One answer: sum over the ranks, then divide by their number (the mean of the means)."""
    for p in model.parameters():
        ctx.comm.all_reduce(p.grad, tag="gradients")
        p.grad /= ctx.world_size


def train_replicas(ctx, sync_fn, steps=STEPS):
    """Data parallelism by hand: my shard, backward, `sync_fn`, SGD step; my parameters."""
    model = exercise_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    after = []
    for step in range(steps):
        x, y = (t.chunk(ctx.world_size)[ctx.rank] for t in exercise_batch(step))
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        sync_fn(ctx, model)
        optimizer.step()
        after.append(_flat(model))
    return after


def reference(steps=STEPS):
    """One device, the whole batch: the flat parameters after each step."""
    model = exercise_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    after = []
    for step in range(steps):
        x, y = exercise_batch(step)
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        after.append(_flat(model))
    return after


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


SYNC_HINTS = Hints(
    concept="every rank must end with the gradient of the whole batch's mean loss: the mean "
            "of the ranks' gradients (each rank's loss is already a mean over its half), the "
            "same collective on every rank in the same order.",
    code="for p in model.parameters(): ctx.comm.all_reduce(p.grad) (sums in place), then "
         "p.grad /= ctx.world_size.")


MFU_HINTS = Hints(
    concept="MFU is the model's FLOPs per second (what training the model needs per token, "
            "times the tokens per second) over what the GPUs could do at their dense peak.",
    code=lambda: f"6 x params x tokens/s / (GPUs x dense bf16 peak) = 6 x "
                 f"{catalog.model(MFU_RUN['model']).param_count():,} x "
                 f"{MFU_RUN['tokens_per_s']:,} / ({MFU_RUN['gpus']} x "
                 f"{hardware.gpu(MFU_RUN['gpu']).bf16_flops:.3g}).",
    exercise=2, kind="formula")


def show_solution(exercise=1):
    """Print the code (exercise 1) or the formula (exercise 2)."""
    show({1: SYNC_HINTS, 2: MFU_HINTS}, exercise)


def check_gradient_sync(sync_fn, world_size=2, timeout_s=60, verbose=True):
    """Run `sync_fn(ctx, model)` after each backward on `world_size` ranks; a `Check`."""
    from ..runtime.launch import LaunchError, launch
    if (refused := not_a_function(sync_fn, "sync_fn(ctx, model)")) is not None:
        return say(refused, verbose)
    try:
        runs = launch(train_replicas, world_size, sync_fn, timeout_s=timeout_s)
    except LaunchError as error:
        return say(with_hint(_failed_run(str(error)), SYNC_HINTS), verbose)
    start = _flat(exercise_model())
    ref = reference()
    drift = max((runs[r][0] - runs[0][0]).abs().max().item() for r in range(world_size))
    if drift > 1e-6:
        return say(Check(False, "replicas differ", (
            f"NOT SYNCHRONISED: after one step rank 0 and the others differ by up to "
            f"{drift:.1e}. Each rank stepped with the gradient of its own half of the batch, so "
            f"the replicas drift apart. {SYNC_HINTS.after_failure()}")), verbose)
    mine, truth = runs[0][0] - start, ref[0] - start
    ratio = float(mine @ truth / (truth @ truth))
    diff = max((a - b).abs().max().item() for a, b in zip(runs[0], ref))
    if diff <= 1e-5:
        return say(Check(True, "", (
            f"CORRECT: after {STEPS} steps on {world_size} ranks the parameters equal one "
            f"device's (max diff {diff:.1e}); the first update is {ratio:.3f}x the reference's.")),
            verbose)
    if abs(ratio - world_size) < 0.05 * world_size:
        return say(Check(False, "summed", (
            f"SUMMED, NOT AVERAGED: the replicas agree, but every update is {ratio:.2f}x the "
            f"single-device one (max diff {diff:.1e} after {STEPS} steps). Each rank's loss is "
            f"already a mean over its shard; adding {world_size} such gradients multiplies the "
            f"step by {world_size}, like a {world_size}x learning rate. "
            f"{SYNC_HINTS.after_failure()}")), verbose)
    return say(Check(False, "wrong result", (
        f"WRONG RESULT: the replicas agree, but differ from one device by {diff:.1e} after "
        f"{STEPS} steps (first update {ratio:.2f}x the reference's; 1.00 is right). "
        f"{SYNC_HINTS.after_failure()}")),
        verbose)


def _failed_run(text):
    if "NotImplementedError" in text:
        return Check(False, "not written", (
            "NOT WRITTEN YET: sync_fn raised NotImplementedError. Replace the raise with your "
            f"code. Hint: {SYNC_HINTS.concept}"))
    if (busy := not_started(text)) is not None:
        return Check(False, "slow", busy)
    if "timed out" in text:
        waits = "\n".join(line for line in text.splitlines() if line.startswith("  rank"))
        return Check(False, "deadlock", (
            f"HANG: the ranks still waited at the timeout:\n{waits}\nEvery rank must call the "
            "same collectives in the same order (no collective under `if ctx.rank == 0`)."))
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        return Check(False, "one-sided collective", (
            "HANG, CUT SHORT: one rank waited in a collective while another had finished and "
            "left (gloo then reports the connection closed or reset by the peer). Every rank "
            "must call the same collectives in the same order (no collective under "
            "`if ctx.rank == 0`)."))
    last = [line for line in text.splitlines() if line.strip()][-1].strip()
    return Check(False, "raised", f"YOUR CODE RAISED on a rank: {last}.")


MFU_RUN = dict(model="llama-3-8b", gpus=64, gpu="H100", tokens_per_s=600_000)


def check_mfu_answer(answer, model=MFU_RUN["model"], gpus=MFU_RUN["gpus"], gpu=MFU_RUN["gpu"],
                     tokens_per_s=MFU_RUN["tokens_per_s"], verbose=True):
    """The MFU (a fraction) of a run training `tokens_per_s` tokens/s on `gpus` GPUs."""
    psi, peak = catalog.model(model).param_count(), hardware.gpu(gpu).bf16_flops
    expected = training_flops(psi, tokens_per_s) / (gpus * peak)
    a100 = hardware.gpu("A100").bf16_flops
    mistakes = [
        Mistake(expected / 2, "sparse peak", "that divides by the sparse peak, twice the dense "
                "one; 2:4 sparsity is not what training runs: use the dense bf16 peak"),
        Mistake(expected / 3, "forward only", "that counts 2 x params FLOPs per token, the "
                "forward alone; training adds the backward (twice the forward): 6 x params"),
        Mistake(expected * 4 / 3, "recompute", "that counts 8 x params per token, a recomputed "
                "forward included: that is the HFU; MFU counts the model's 6 x params only"),
        Mistake(expected * gpus, "one GPU", f"the tokens/s are for all {gpus} GPUs together: "
                f"divide by {gpus} x the peak of one"),
        Mistake(expected * peak / a100, "wrong GPU", "that uses the A100's peak; the run is on "
                "H100s"),
        Mistake(expected / gpus, "GPUs twice", f"that divides by the {gpus} GPUs twice: the "
                "tokens/s are the whole run's, the peak is one GPU's"),
    ]
    flops = training_flops(psi, tokens_per_s)
    round_psi = float(f"{psi:.1g}")                       # 8.03e9 -> 8e9
    round_peak = float(f"{peak:.1g}")                     # 989e12 -> 1e15
    roundings = [
        Rounding(flops / (gpus * round_peak), f"the peak rounded to {round_peak / 1e15:g} "
                 f"PFLOP/s (it is {peak / 1e12:.0f} TFLOP/s)"),
        Rounding(training_flops(round_psi, tokens_per_s) / (gpus * peak), f"the parameters "
                 f"rounded to {round_psi / 1e9:g}e9 (they are {psi / 1e9:.2f}e9)"),
        Rounding(training_flops(round_psi, tokens_per_s) / (gpus * round_peak), f"parameters "
                 f"and peak rounded to {round_psi / 1e9:g}e9 and {round_peak / 1e15:g} PFLOP/s"),
    ]
    roundings = [r for r in roundings if abs(r.value / expected - 1) < 0.05]   # reasonable
    return check_number(answer, expected, what=f"the MFU of {tokens_per_s:,} tokens/s on "
                        f"{gpus} {gpu}s ({catalog.model(model).display_name})", unit="fraction",
                        mistakes=mistakes, roundings=roundings, verbose=verbose,
                        hints=MFU_HINTS,
                        explain="Between 0.3 and 0.6 is what good large runs report.")
