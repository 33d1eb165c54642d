"""Lesson 07's exercise: fix a data-parallel gradient sync that sums instead of averaging.

`check_gradient_sync(sync_fn)` trains a small nn.Sequential on 2 ranks, each on its half of
every batch; after each backward it calls the learner's `sync_fn(ctx, model)`, which must leave
every rank holding the gradient of the *full* batch's mean loss. It compares the parameters
with one device trained on the whole batch and says, in words, what went wrong: not written
yet, a hang, replicas that drift apart (no sync), updates N times too large (summed, not
averaged), or some other difference. It answers with a `Check`; it never raises.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Check, say

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


HINT = ("Hint: for every parameter p, all-reduce p.grad (ctx.comm.all_reduce sums in place), "
        "then divide it by ctx.world_size.")


def check_gradient_sync(sync_fn, world_size=2, timeout_s=60, verbose=True):
    """Run `sync_fn(ctx, model)` after each backward on `world_size` ranks; a `Check`."""
    from ..runtime.launch import LaunchError, launch
    try:
        runs = launch(train_replicas, world_size, sync_fn, timeout_s=timeout_s)
    except LaunchError as error:
        return say(_failed_run(str(error)), verbose)
    start = _flat(exercise_model())
    ref = reference()
    drift = max((runs[r][0] - runs[0][0]).abs().max().item() for r in range(world_size))
    if drift > 1e-6:
        return say(Check(False, "replicas differ", (
            f"NOT SYNCHRONISED: after one step rank 0 and the others differ by up to "
            f"{drift:.1e}. Each rank stepped with the gradient of its own half of the batch, so "
            f"the replicas drift apart. {HINT}")), verbose)
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
            f"step by {world_size}, like a {world_size}x learning rate. {HINT}")), verbose)
    return say(Check(False, "wrong result", (
        f"WRONG RESULT: the replicas agree, but differ from one device by {diff:.1e} after "
        f"{STEPS} steps (first update {ratio:.2f}x the reference's; 1.00 is right). {HINT}")),
        verbose)


def _failed_run(text):
    if "NotImplementedError" in text:
        return Check(False, "not written", (
            f"NOT WRITTEN YET: sync_fn raised NotImplementedError. Replace the raise with your "
            f"code. {HINT}"))
    if "timed out" in text:
        waits = "\n".join(line for line in text.splitlines() if line.startswith("  rank"))
        return Check(False, "deadlock", (
            f"HANG: the ranks still waited at the timeout:\n{waits}\nEvery rank must call the "
            f"same collectives in the same order (no collective under `if ctx.rank == 0`). "
            f"{HINT}"))
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        return Check(False, "one-sided collective", (
            "HANG, CUT SHORT: one rank waited in a collective while another had finished and "
            "left (gloo then reports the connection closed or reset by the peer). Every rank "
            "must call the same collectives in the same order (no collective under "
            f"`if ctx.rank == 0`). {HINT}"))
    last = [line for line in text.splitlines() if line.strip()][-1].strip()
    return Check(False, "raised", f"YOUR CODE RAISED on a rank: {last}. {HINT}")
