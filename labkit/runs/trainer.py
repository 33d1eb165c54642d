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

from .. import data
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


def batch_shard(ctx):
    """`shard` of data parallelism: this rank's 1/N of the batch, of x and of y."""
    return lambda x, y: tuple(data.shard(t, ctx.rank, ctx.world_size) for t in (x, y))


class Trainer:
    """Trains `model` (after `parallelize(model)`, if given) for `cfg.steps` steps.

    cfg: the RunConfig (steps, ...). optimizer: a factory `(params, cfg)` (the run's
    `reference.build_optimizer`) or an optimizer already built. batch: `(model, cfg, step,
    dtype) -> (x, y)`, the global batch of a step (`reference.batch`). shard: `(x, y) -> (x,
    y)`, this rank's part of it. loss: `(module, x, y) -> loss` (default `module(x, y)`).
    accumulate: micro-batches per step, all but the last under `no_sync()`. step_fn: `(x, y)
    -> loss` run in place of forward and backward (a pipeline schedule). fused: one clock region
    "forward+backward", not two. samples: sample memory after forward and after backward.
    dtype: cast the batch's floating tensors (the float64 reference). progress: steps in the
    launch's progress bar. The technique's own collectives: after_backward(), after_step(step),
    record_loss(loss) (e.g. averaged over ranks), or a subclass's `train_step`.
    """

    def __init__(self, ctx, cfg, model, parallelize=None, *, optimizer, batch, shard=None,
                 loss=None, after_backward=None, after_step=None, record_loss=None,
                 accumulate=1, no_sync=None, step_fn=None, fused=False, samples=False,
                 watch=True, track_activations=True, dtype=None,
                 optimizer_region="optimizer step", progress=True):
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a positive integer, got {accumulate!r}")
        self.ctx, self.cfg, self.model = ctx, cfg, model
        self.module = parallelize(model) if parallelize is not None else model
        self.optimizer = (optimizer(self.module.parameters(), cfg) if callable(optimizer)
                          else optimizer)
        self.memory = ctx.memory if ctx is not None else MemoryTracker()
        if watch:
            self.memory.watch(model=self.module, optimizer=self.optimizer)
        self._batch, self._shard, self._loss = batch, shard, loss
        self._after_backward, self._after_step = after_backward, after_step
        self._record_loss, self.accumulate, self.no_sync = record_loss, accumulate, no_sync
        self.step_fn, self.fused, self.samples, self.dtype = step_fn, fused, samples, dtype
        self.track, self.optimizer_region = track_activations, optimizer_region
        self.progress, self.step_index = progress, None
        self.losses, self.step_wall = [], []

    # ------------------------------------------------------------------------- one step
    def train_step(self, step):
        """zero_grad, this rank's batch, forward and backward, after_backward, the optimizer
        step; returns the loss (a tensor or float; None where this rank has none)."""
        self.optimizer.zero_grad(set_to_none=True)
        x, y = self.batch(step)
        with self.activations():
            if self.step_fn is not None:
                loss = self.step_fn(x, y)
            elif self.accumulate == 1:
                loss = self.forward_backward(x, y)
            else:
                loss = self.accumulate_gradients(x, y)
        if self._after_backward is not None:
            self._after_backward()
        if self.samples:
            self.memory.sample("after backward")
        with self.region(self.optimizer_region):
            self.optimizer.step()
        return loss

    def batch(self, step):
        """This rank's (x, y) of `step`: the global batch, then `shard`."""
        x, y = self._batch(self.model, self.cfg, step, self.dtype)
        return self._shard(x, y) if self._shard is not None else (x, y)

    def forward_backward(self, x, y, suffix=""):
        """Forward and backward on the clock; returns the loss (divided by `accumulate`, so
        that the micro-batches' gradients add up to the batch's mean gradient)."""
        with self.region("forward+backward" + suffix if self.fused else "forward" + suffix):
            loss = self._loss(self.module, x, y) if self._loss else self.module(x, y)
            if self.accumulate > 1:
                loss = loss / self.accumulate
            if self.fused:
                loss.backward()
                return loss
        if self.samples:
            self.memory.sample("after forward")
        with self.region("backward" + suffix):
            loss.backward()
        return loss

    def accumulate_gradients(self, x, y):
        """K micro-batches, gradients accumulating; all but the last under `no_sync()` (DDP:
        one all-reduce per step). Returns the batch's loss, the sum of the K scaled ones."""
        total, k_all = 0.0, self.accumulate
        for k, (mx, my) in enumerate(zip(x.chunk(k_all), y.chunk(k_all))):
            quiet = self.no_sync() if self.no_sync and k < k_all - 1 else nullcontext()
            with quiet:
                total += self.forward_backward(mx, my, f" (micro-batch {k})").item()
        return total

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
                self.losses.append(self._record_loss(loss) if self._record_loss
                                   else loss if isinstance(loss, float) else loss.item())
            if self._after_step is not None:
                self._after_step(step)
        return self

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
        if self.ctx is None:
            yield
            self.memory.sample(f"after step {index}")
            return
        with self.ctx.step(index, self.cfg.steps if self.progress else None):
            yield
