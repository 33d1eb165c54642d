"""Async TP against plain sequence-parallel TP and one device: the same steps, the same bytes, and
how much of the sequence communication the virtual clock sees hidden under the matmuls.

`train_one(build, plan, loss, async_tp=...)` (on every rank of a launch) trains a module split
by `parallelize_module(..., sequence_parallel=True, async_tp=...)` and returns its losses, gathered
parameters, wire bytes and the clock's exposed / hidden seconds per op; `train_single` the
single-device reference (float32, float64 for labkit.numerics, or bf16). `compare` runs both
TP paths and the references on TinyGPT and on a wide MLP block (big enough that one chunk's
matmul, modelled on an H100, outlasts one chunk's NVLink message); lesson 03 prints it.
"""
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import models, numerics
from ..parallel.parallel_styles import parallelize_module
from ..parallel.tensor_parallel import gather_params
from ..runtime.context import context
from ..runtime.trace import hidden_share, overlap_by_op
from ..parallel.tensor_parallel_plan import gpt_plan
from .trainer import Trainer

RING = ("send", "recv")


def gpt():
    return models.TinyGPT()


def gpt_loss(model, step):
    g = torch.Generator().manual_seed(step)
    idx, targets = (torch.randint(0, 128, (4, 32), generator=g) for _ in range(2))
    return model(idx, targets)


def wide_mlp(hidden=512, ffn=2048):
    """One transformer MLP block, wide enough for the clock to see the ring hide."""
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


MLP_PLAN = {"0": "colwise", "2": "rowwise"}


def mlp_loss(model, step, tokens=512):
    """Mean squared error over the whole sequence; split (sequence parallel), this rank's share
    of it: its tokens' squared errors / all the elements, so the shares sum to the mean."""
    g = torch.Generator().manual_seed(step)
    x, y = (torch.randn(1, tokens, model[0].in_features, generator=g) for _ in range(2))
    x, y = numerics.cast((x, y), numerics.dtype_of(model))
    group = getattr(model[0], "group", None)
    if group is None:                     # one device: the whole sequence
        return F.mse_loss(model(x), y)
    mine_x, mine_y = (t.chunk(group.size, dim=1)[group.rank] for t in (x, y))
    return F.mse_loss(model(mine_x), mine_y, reduction="sum") / y.numel()


def _train(model, optimizer, loss_fn, steps):
    """The Trainer on this rank's context, `steps` steps: `loss_fn(model, step)` makes its own
    data, one clock region "forward+backward", the SGD step outside any region; returns the
    detached losses."""
    trainer = Trainer(context(), SimpleNamespace(steps=steps), model, optimizer=optimizer,
                      batch=lambda step: (step, None),
                      loss=lambda model, step, _: loss_fn(model, step), fused=True,
                      track_activations=False, optimizer_region=None,
                      reduce_loss=lambda loss: loss.detach(), progress=False)
    return trainer.fit().losses


def train_single(build, loss_fn, *, steps=2, dtype=torch.float32, lr=0.1):
    """One device: losses and parameters after `steps` SGD steps in `dtype`."""
    torch.manual_seed(0)
    model = build().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    clock = context().clock
    clock.enabled, was = False, clock.enabled
    try:
        losses = [loss.item() for loss in _train(model, optimizer, loss_fn, steps)]
    finally:
        clock.enabled = was
    return dict(losses=losses, params={k: p.detach().clone() for k, p in
                                       model.named_parameters()})


def train_one(build, plan, loss_fn, *, async_tp, steps=2, dtype=torch.float32, lr=0.1,
              group=None, sharded_loss=False, regather=True):
    """The module split over `group` with sequence parallelism, plain or async (`regather`
    as in parallelize_module); what the comparison looks at."""
    ctx = context()
    ctx.comm.reset()
    torch.manual_seed(0)
    model = parallelize_module(build().to(dtype), group, plan, sequence_parallel=True,
                               regather=regather, async_tp=async_tp)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    first_event = len(ctx.clock.events)
    losses = _train(model, optimizer, loss_fn, steps)
    if sharded_loss:   # each rank's loss is its share of the whole: sum them
        with ctx.off_the_record():
            losses = [ctx.comm.all_reduce(loss, group=group) for loss in losses]
    losses = [loss.item() for loss in losses]
    calls = {row["op"]: row["calls"] for row in ctx.comm.summary(by=("op",))}
    wire = ctx.comm.wire_bytes()
    overlap = overlap_by_op(ctx.clock.timeline()[first_event:], rank=ctx.rank)
    with ctx.off_the_record():
        params = gather_params(model)
    return dict(losses=losses, params=params, wire_bytes=wire, calls=calls,
                overlap=overlap, step_s=ctx.clock.step_times()[-steps:])


CASES = (("TinyGPT", gpt, gpt_plan(True), gpt_loss), ("wide MLP", wide_mlp, MLP_PLAN, mlp_loss))


def compare(ctx, steps=1):
    """On every rank: TinyGPT (fp32) and the wide MLP, plain and async TP, against one device
    (numerics verdicts), wire bytes, and the clock's hidden share of the sequence traffic."""
    out = {}
    for name, build, plan, loss_fn in CASES:
        single = train_single(build, loss_fn, steps=steps)
        exact = train_single(build, loss_fn, steps=steps, dtype=torch.float64)
        for mode in ("plain", "async"):
            run = train_one(build, plan, loss_fn, async_tp=mode == "async", steps=steps,
                            sharded_loss=loss_fn is mlp_loss)
            out[name, mode] = dict(
                loss=numerics.compare_loss(run["losses"], single["losses"], exact["losses"]),
                params=numerics.compare(run["params"], single["params"], exact["params"]),
                wire_bytes=run["wire_bytes"], calls=run["calls"], step_s=run["step_s"],
                sequence=hidden_share(run["overlap"], ("all_gather", "reduce_scatter") + RING),
                ring=hidden_share(run["overlap"], RING),
                blocking=hidden_share(run["overlap"], ("all_gather", "reduce_scatter")))
    return out
