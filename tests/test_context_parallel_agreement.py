"""ContextParallel agrees that no rank has a problem once, on its first attention call: two
forwards of a wrapped two-layer model on 2 ranks, every collective each rank enters counted
(`ctx.collectives`, the guard's off-the-record all-reduce included)."""
import torch
import torch.nn as nn

import labkit
from labkit import models
from labkit.parallel.context_parallelism import ContextParallel, shard_sequence

GUARD_TAG = "context parallel: can every rank run this call?"


def two_forwards(ctx):
    torch.manual_seed(0)
    model = nn.Sequential(models.Attention(16, 2), models.Attention(16, 2))
    wrapped = ContextParallel(model, layout="zigzag", method="all_gather")
    x = shard_sequence(torch.randn(2, 8 * ctx.world_size, 16), None, "zigzag")
    guards, all_reduce = [], ctx.comm.all_reduce

    def counting(tensor, *args, tag="", **kwargs):
        guards.append(tag == GUARD_TAG)
        return all_reduce(tensor, *args, tag=tag, **kwargs)

    ctx.comm.all_reduce = counting
    entered = []
    for _ in range(2):
        before = ctx.collectives
        with torch.no_grad():
            wrapped(x)
        entered.append(ctx.collectives - before)
    return dict(entered=entered, guards=sum(guards))


def test_the_error_agreement_runs_once_not_on_every_attention_call():
    for rank in labkit.launch(two_forwards, 2, timeout_s=120):
        first, second = rank["entered"]
        # each forward: one all-gather of K and V per layer (2); the first also the one guard
        # (an all-reduce on every attention call would add 2 to each forward)
        assert second == 2, rank
        assert first == second + 1 and rank["guards"] == 1, rank
