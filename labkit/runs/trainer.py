"""One training loop for every driver: a technique is the model it builds, not a loop it writes.

torchtitan has one trainer (`torchtitan/train.py`); what makes a run "FSDP" or "TP" is the
`parallelize_fn` applied to the model before training, a plan as data. labkit's drivers do the
same: `Trainer(ctx, cfg, model, parallelize=..., shard=...)` owns the bookkeeping every run
shares (ctx.step marks, the memory watch, `track_activations`, the clock regions "forward",
"backward" (or "forward+backward") and "optimizer step", the losses, the step wall times) and
hands back `rank_result`. What a technique adds stays in its driver, where a learner reads it:
the gradient collective after backward (`after_backward`: the naive DP all-reduce, CP's
average, EP's replica sums), how a rank's share of the batch is cut (`shard`), the loss on
split outputs (`loss`), or the whole step (`train_step`: DDP's no_sync on accumulation, a
pipeline's schedule). One step:

    zero_grad -> x, y = shard(batch(step)) -> forward -> backward -> after_backward -> step

Without a `ctx` (the single-device reference outside a launch) it trains on its own memory
tracker with no clock.
"""
import time
from contextlib import contextmanager, nullcontext

from ..runtime.memory import MemoryTracker


def rank_result(ctx, loss, params=None, **extra):
    """What one rank hands back: its losses, memory, comm summary, clock and (rank 0) params."""
    out = dict(rank=ctx.rank, loss=list(loss), memory=ctx.memory.report(),
               comm=ctx.comm.summary(), wall_s=ctx.elapsed(),
               modelled_step_s=ctx.clock.step_times(), timeline=ctx.clock.timeline(),
               backend=ctx.backend, cluster=ctx.clock.cluster.name)
    if params is not None:
        out["params"] = params
    out.update(extra)
    return out


class Trainer:
    """Trains `model` (after `parallelize(model)`, if given) for `cfg.steps` steps.

    cfg: the RunConfig (steps, batch, optimizer). optimizer: a factory `(params, cfg)` (the
    run's `reference.build_optimizer`) or an optimizer already built. batch: `(model, cfg,
    step, dtype) -> (x, y)`, the global batch of a step (`reference.batch`). shard: `(x, y)
    -> (x, y)`, this rank's part of it (default: all of it). loss: `(module, x, y) -> loss`.
    fused: one clock region "forward+backward" instead of two. samples: sample memory after
    forward and after backward. dtype: cast the batch's floating tensors (the float64
    reference). progress: show the steps in the launch's progress bar. Pass the hooks
    (after_backward(), after_step(step), record_loss(loss)), or subclass and override
    `train_step`, to add a technique's collectives."""

    def __init__(self, ctx, cfg, model, parallelize=None, *, optimizer, batch, shard=None,
                 loss=None, after_backward=None, after_step=None, record_loss=None, fused=False,
                 samples=False, watch=True, track_activations=True, dtype=None,
                 optimizer_region="optimizer step", progress=True):
        self.ctx, self.cfg, self.model = ctx, cfg, model
        self.module = parallelize(model) if parallelize is not None else model
        self.optimizer = (optimizer(self.module.parameters(), cfg) if callable(optimizer)
                          else optimizer)
        self.memory = ctx.memory if ctx is not None else MemoryTracker()
        if watch:
            self.memory.watch(model=self.module, optimizer=self.optimizer)
        self._batch, self._shard, self._loss = batch, shard, loss
        self._after_backward, self._after_step = after_backward, after_step
        self._record_loss, self.step_index = record_loss, None
        self.fused, self.samples, self.dtype = fused, samples, dtype
        self.track, self.optimizer_region = track_activations, optimizer_region
        self.progress = progress
        self.losses, self.step_wall = [], []

    # ------------------------------------------------------------------ the hooks of one step
    def batch(self, step):
        """This rank's (x, y) of `step`: the global batch, then `shard`."""
        x, y = self._batch(self.model, self.cfg, step, self.dtype)
        return self._shard(x, y) if self._shard is not None else (x, y)

    def loss(self, x, y):
        """The loss the rank differentiates (default: the model's own, `module(x, y)`)."""
        return self._loss(self.module, x, y) if self._loss is not None else self.module(x, y)

    def after_backward(self):
        """The technique's gradient collective (default: none)."""
        if self._after_backward is not None:
            self._after_backward()

    def forward_backward(self, x, y, suffix=""):
        """Forward and backward on the clock; returns the loss."""
        if self.fused:
            with self.region("forward+backward" + suffix):
                loss = self.loss(x, y)
                loss.backward()
            return loss
        with self.region("forward" + suffix):
            loss = self.loss(x, y)
        if self.samples:
            self.memory.sample("after forward")
        with self.region("backward" + suffix):
            loss.backward()
        return loss

    def train_step(self, step):
        """One step; returns its loss (a tensor or float; None where this rank has none)."""
        self.optimizer.zero_grad(set_to_none=True)
        x, y = self.batch(step)
        with self.activations():
            loss = self.forward_backward(x, y)
        self.after_backward()
        if self.samples:
            self.memory.sample("after backward")
        self.optimizer_step()
        return loss

    def optimizer_step(self):
        with self.region(self.optimizer_region):
            self.optimizer.step()

    # -------------------------------------------------------------------------- the run
    def fit(self):
        """All `cfg.steps` steps; returns self (losses, step_wall filled in)."""
        for step in range(self.cfg.steps):
            self.step_index = step
            with self.step(step):
                started = time.perf_counter()
                loss = self.train_step(step)
                self.step_wall.append(time.perf_counter() - started)
            if loss is not None:
                self.losses.append(self.record_loss(loss))
            if self._after_step is not None:
                self._after_step(step)
        return self

    def record_loss(self, loss):
        """The number kept for a step (`record_loss(loss)`: e.g. averaged over ranks)."""
        if self._record_loss is not None:
            return self._record_loss(loss)
        return loss if isinstance(loss, float) else loss.item()

    def result(self, params=None, **extra):
        """`rank_result` of this rank: losses, memory, comm, clock, (rank 0) params."""
        return rank_result(self.ctx, self.losses, params=params, **extra)

    # ------------------------------------------------------------------ the instruments
    def region(self, name):
        """A clock region (none without a ctx, or for a region named None)."""
        if self.ctx is None or name is None:
            return nullcontext()
        return self.ctx.clock.compute(name)

    def activations(self):
        return self.memory.track_activations() if self.track else nullcontext()

    @contextmanager
    def step(self, index):
        if self.ctx is not None:
            with self.ctx.step(index, self.cfg.steps if self.progress else None):
                yield
        else:
            yield
            self.memory.sample(f"after step {index}")
