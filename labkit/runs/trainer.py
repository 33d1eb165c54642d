"""One training loop for every driver: a technique is the model it builds, not a loop it writes.

torchtitan has one trainer (`torchtitan/train.py`); what makes a run "FSDP" or "TP" is the
`parallelize_fn` applied to the model before training, a plan as data. labkit's drivers do the
same: `Trainer(ctx, cfg, model, parallelize, optimizer=..., batch=...)` owns the bookkeeping
every run shares (ctx.step marks, the memory watch, `track_activations`, the clock regions
"forward", "backward" (or "forward+backward") and "optimizer step", the losses, the step wall
times) and hands back `rank_result`. What a technique adds stays in its driver, where a learner
reads it, as one of four hooks:

    zero_grad -> x, y = batch(step) -> forward_backward(x, y) -> after_backward()
              -> optimizer.step() -> after_step(step)

`batch(step)`: this rank's part of the step's batch (DP's 1/N of the rows, CP's shard of each
sequence); `forward_backward(x, y) -> loss` replaces forward and backward (a pipeline's
schedule, torchtitan's `pp_schedule.step`); `after_backward()`: the gradient collective (the
naive DP all-reduce, CP's average, EP's replica sums); `after_step(step)`: what to record after
the update (routing statistics, memory samples). Gradient accumulation (`accumulate=K`) runs
all but the last micro-batch under the module's `no_sync()` where it has one (DDP).

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


def rows(ctx, batch, cfg, model):
    """`batch` of data parallelism: this rank's 1/N of the rows of the step's global batch
    (`batch(model, cfg, step)`, e.g. reference.batch), of x and of y."""
    return lambda step: tuple(data.shard(t, ctx.rank, ctx.world_size)
                              for t in batch(model, cfg, step))


class Optimizers:
    """Several optimizers stepped as one (torchtitan's `OptimizersContainer`): the mesh's
    dense parameters average over dp x cp and its experts over `ep_dp`, so each group has its
    own (ZeRO-1 shards each over its own group). `state`: all their states, for the memory
    watch."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    @property
    def state(self):
        return {k: v for optimizer in self.optimizers for k, v in optimizer.state.items()}


class Trainer:
    """Trains `model` (after `parallelize(model)`, if given) for `cfg.steps` steps.

    cfg: the RunConfig (steps, ...). optimizer: a factory `(params, cfg)` (the run's
    `reference.build_optimizer`; the trainer then watches the module's memory) or one a driver
    built and watches itself (ZeRO's ShardedOptimizer, the mesh's `Optimizers`). batch, loss
    (`(module, x, y) -> loss`, default `module(x, y)`), forward_backward, after_backward,
    after_step: the hooks of the module docstring. reduce_loss: what is recorded of a step's
    loss (default `.item()`; CP: the mean over the ranks' shards). fused: one clock region
    "forward+backward", not two; samples: sample memory after forward and after backward;
    optimizer_region: the clock region of the step (None: none); progress: steps in the
    launch's progress bar (not the reference's, which the CLI runs beside the ranks' report).
    """

    def __init__(self, ctx, cfg, model, parallelize=None, *, optimizer, batch, loss=None,
                 forward_backward=None, after_backward=None, after_step=None,
                 reduce_loss=None, accumulate=1, fused=False, samples=False,
                 track_activations=True, optimizer_region="optimizer step", progress=True):
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a positive integer, got {accumulate!r}")
        if forward_backward is not None and accumulate > 1:
            raise ValueError("accumulate splits the batch for the trainer's forward_backward; a "
                             "forward_backward hook (a pipeline) makes its own micro-batches")
        if optimizer is None or not (hasattr(optimizer, "step") or callable(optimizer)):
            raise TypeError(f"optimizer must be an optimizer (with .step()) or a factory "
                            f"(params, cfg) -> optimizer, got {optimizer!r:.60}")
        if not callable(batch):
            raise TypeError(f"batch must be a function step -> (x, y), got {batch!r:.60}")
        self.ctx, self.cfg, self.model = ctx, cfg, model
        self.module = parallelize(model) if parallelize is not None else model
        self.memory = ctx.memory if ctx is not None else MemoryTracker()
        if not hasattr(optimizer, "step"):   # a factory: built here, so watched here
            optimizer = optimizer(self.module.parameters(), cfg)
            self.memory.watch(model=self.module, optimizer=optimizer)
        self.optimizer, self.batch, self._loss = optimizer, batch, loss
        if forward_backward is not None:
            self.forward_backward = forward_backward
        self._after_backward, self._after_step = after_backward, after_step
        self._reduce_loss, self.accumulate = reduce_loss, accumulate
        self.fused, self.samples, self.track = fused, samples, track_activations
        self.optimizer_region, self.progress, self.step_index = optimizer_region, progress, None
        self.losses, self.step_wall = [], []

    # ------------------------------------------------------------------------- one step
    def train_step(self, step):
        """zero_grad, this rank's batch, forward and backward, after_backward, the optimizer
        step; returns the loss (a tensor or float; None where this rank has none)."""
        self.optimizer.zero_grad(set_to_none=True)
        x, y = self.checked_batch(step)
        with self.activations():
            loss = (self.forward_backward(x, y) if self.accumulate == 1
                    else self.accumulate_gradients(x, y))
        if self._after_backward is not None:
            self._after_backward()
        if self.samples:
            self.memory.sample("after backward")
        with self.region(self.optimizer_region):
            self.optimizer.step()
        return loss

    def checked_batch(self, step):
        """The batch hook's (x, y) for `step`, refused in one line when it is not a pair, or
        when `accumulate` does not divide its rows (x.chunk would make fewer or unequal
        micro-batches: 8 rows in 3 end 5.6e-4 away from accumulate=1, without a word)."""
        got = self.batch(step)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise TypeError(f"batch(step) must return (x, y), got {type(got).__name__} "
                            f"{got!r:.60} at step {step}")
        x, y = got
        rows = getattr(x, "shape", (None,))[0] if getattr(x, "ndim", 0) else None
        if self.accumulate > 1 and (rows is None or rows % self.accumulate):
            raise ValueError(f"accumulate={self.accumulate} must divide this rank's "
                             f"{rows} rows of the batch (into equal micro-batches)")
        return x, y

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
        """K micro-batches, gradients accumulating; all but the last under the module's
        `no_sync()` (DDP: one all-reduce per step). Returns the batch's loss, the sum of the K
        scaled ones."""
        total, k_all = 0.0, self.accumulate
        no_sync = getattr(self.module, "no_sync", None)
        for k, (mx, my) in enumerate(zip(x.chunk(k_all), y.chunk(k_all))):
            quiet = no_sync() if no_sync is not None and k < k_all - 1 else nullcontext()
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
                self.losses.append(self._reduce_loss(loss) if self._reduce_loss
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
