"""Pipeline parallelism as a building block: `PipelineStage` and one executor that runs any
schedule, named as torch.distributed.pipelining names them: `ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B` (each just names its schedule for `PipelineSchedule`, the executor).

Idea (GPipe, Huang et al. 2019, arXiv 1811.06965): cut the layers into S contiguous stages over
the P ranks of a group (stage s on group rank s % P, so V = S/P stages per rank when
interleaved, Narayanan et al. 2021, arXiv 2104.04473), cut the batch into M micro-batches and let
the stages work on different micro-batches at once. F (forward) of micro-batch m on stage s:
receive the activation from stage s-1, run the stage, send its output to stage s+1. B: receive
the gradient of that output from stage s+1, run backward, send the input's gradient to s-1.
The loss is the mean over micro-batches, so the gradients equal the full batch's.

Memory per rank: 1/P of the weights, gradients and optimizer state, plus the activations of
the micro-batches in flight (GPipe: M, 1F1B: at most P - r on rank r).
Communication per step, point to point only: each stage boundary carries every micro-batch's
activation forward and its gradient back (2 x batch x boundary-activation bytes per boundary).
Idle share (bubble) with equal stages and free links: (P-1)/(V*M + P-1).

    stages = split_into_stages(model, 4)    # nn.Sequential, labkit's GPT, a transformers LM
    stage = PipelineStage(stages[rank], rank, 4, device, group=pp_group)   # torch's order
    pipe = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    if stage.is_first:
        pipe.step(x)
    else:                                    # the last stage gets the output and the losses
        losses = []
        output = pipe.step(target=y, losses=losses)
    optimizer.step()

`PipelineSchedule(stage, M, loss_fn, schedule="1f1b")` takes any schedule (a name, or the data
itself: labkit's schedules as data, labkit.theory.pipeline) and returns the mean loss; with a
torch schedule's name it is a deprecated spelling of that class.
"""
import warnings
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from ..runtime.comm import GroupLike
from ..runtime.context import context
from ..runtime.mesh import group_of
from ..theory import pipeline as schedules
from .hf_stages import hf_as_sequential, is_hf_model, sum_tied_gradients, untie_across_stages

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
HEADER_SLOTS = 8  # a shape header: dtype code, number of dims, up to 6 dims (int64)


def split_into_stages(model, num_stages, balance="params", verify=True):
    """Cut `model` into `num_stages` contiguous nn.Sequential stages (modules shared, not copied).

    model: an nn.Sequential (its children are the layers), a model with `as_sequential()`
    (labkit's TinyGPT: embeddings, each block, norm + head), or a transformers causal LM
    (Llama-style or GPT-2, checked first: see hf_stages; a tied embedding and head on two
    stages get two copies whose gradients the schedule sums). balance: "params" (the heaviest
    stage as light as possible by parameter count), "layers" (equal numbers of layers), or a
    list of layers per stage. Stage s runs on group rank s % P; a parameter shared by two stages
    (tied weights) is refused, since its two gradients would need an extra all-reduce.
    verify=False skips the check of a transformers model's units on a miniature (hf_stages).
    """
    hf = is_hf_model(model)
    layers = (hf_as_sequential(model, verify=verify) if hf else
              model.as_sequential() if hasattr(model, "as_sequential") else model)
    if not isinstance(layers, nn.Sequential):
        raise TypeError(f"split_into_stages cuts an nn.Sequential (or a model with "
                        f"as_sequential()), not a {type(model).__name__}: put its layers in "
                        "an nn.Sequential")
    units = list(layers)
    if isinstance(balance, str):
        if balance not in ("params", "layers"):
            raise ValueError(f"balance must be 'params', 'layers' or a list, not {balance!r}")
        weights = [sum(p.numel() for p in u.parameters()) if balance == "params" else 1
                   for u in units]
        sizes = schedules.balanced_split(weights, num_stages)
    else:
        sizes = [int(s) for s in balance]
        if len(sizes) != num_stages or sum(sizes) != len(units) or min(sizes) < 1:
            raise ValueError(f"balance {sizes} must give {num_stages} stages of >= 1 layer "
                             f"each, {len(units)} layers in all")
    stages, start = [], 0
    for size in sizes:
        stages.append(layers[start:start + size])
        start += size
    if hf:
        untie_across_stages(stages)
    owner = {}
    for index, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            if owner.setdefault(id(p), index) != index:
                raise ValueError(f"parameter {name} is shared by stages {owner[id(p)]} and "
                                 f"{index} (tied weights): untie it or keep both on one stage")
    return stages


class PipelineStage:
    """One stage of a pipeline, in torch's order: `submodule` is stage `stage_index` of
    `num_stages`, on `device` (None: this rank's), run on rank stage_index % P of `group` (None:
    the world). input_args: one micro-batch's input to this stage (a tensor, or a tuple of
    one), as torch takes it; labkit reads its shape and dtype (as input_shape= / input_dtype=).
    output_args: one micro-batch's output, checked against the first one the stage makes.
    When every stage but the first knows its input, no shapes are exchanged; otherwise each
    boundary sends a small header once. The old order, a group fourth, still runs (deprecated).
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | str | int | None = None, input_args=None,
                 output_args=None, group: GroupLike = None, *,
                 input_shape: Sequence[int] | None = None,
                 input_dtype: torch.dtype = torch.float32) -> None:
        ctx = context()
        if device is not None and not isinstance(device, (torch.device, str, int)):
            warnings.warn("PipelineStage(module, stage, num_stages, group) is deprecated: "
                          "torch's order is PipelineStage(module, stage, num_stages, device, "
                          "group=group)", DeprecationWarning, stacklevel=2)
            device, group = None, device
        self.device = ctx.device if device is None else _on_this_rank(device, ctx.device)
        self.group = ctx.group(group_of(group))            # a group, or a 1-D DeviceMesh
        p = self.group.size
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} is not in 0..{num_stages - 1}")
        if num_stages % p:
            raise ValueError(f"{num_stages} stages do not spread evenly over the {p} ranks of "
                             "the group (stage s runs on group rank s % P)")
        if stage_index % p != self.group.rank:
            raise ValueError(f"stage {stage_index} runs on group rank {stage_index % p} "
                             f"(s % P), not on this rank ({self.group.rank})")
        self.module, self.stage_index, self.num_stages = submodule, stage_index, num_stages
        self.submod = submodule                # torch's name for it
        self.chunk = stage_index // p          # which of this rank's stages it is
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        if input_args is not None:
            example = _one_tensor(input_args, "input_args")
            input_shape, input_dtype = example.shape, example.dtype
        self.input_shape = None if input_shape is None else tuple(input_shape)
        self.input_dtype = input_dtype
        self.output_meta = None if output_args is None else (
            lambda t: (tuple(t.shape), t.dtype))(_one_tensor(output_args, "output_args"))

    def parameters(self):
        return self.module.parameters()

    def __repr__(self):
        return (f"PipelineStage({self.stage_index}/{self.num_stages} on group rank "
                f"{self.group.rank} of {list(self.group.ranks)})")


def _on_this_rank(device, here):
    """`device` as a torch.device, refused in one line unless it is this rank's."""
    device = torch.device(device) if not isinstance(device, int) else torch.device(
        here.type, device)
    if device.type != here.type or (device.index is not None and here.index is not None
                                    and device.index != here.index):
        raise ValueError(f"PipelineStage: device {device} is not this rank's ({here})")
    return here


def _one_tensor(value, name):
    """The one tensor of `value` (a tensor or a one-tensor tuple/list): labkit's stages pass
    one tensor between them."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"PipelineStage: {name} must be one tensor (labkit's stages pass one "
                        f"tensor between them), not {type(value).__name__}")
    return value


class PipelineSchedule:
    """Runs a schedule over this rank's stages: the one executor behind every schedule.

    The arguments in torch's order; torch's classes (`Schedule1F1B(stage, n_microbatches,
    loss_fn)`, below) each name their schedule for it. stages: this rank's PipelineStage, or
    its list (interleaved: stages r, r+P, ...). n_microbatches: micro-batches per step.
    schedule: "naive", "gpipe", "1f1b", "interleaved", or the data itself (for every group
    rank, its ops ("F"|"B", micro-batch, chunk), see labkit.theory.pipeline); checked before
    anything runs (each op once, F before B, no deadlock). loss_fn(output, target) -> scalar
    on the last stage. recompute: keep only each stage's input and run its forward again in
    backward (activation checkpointing; the forward must be deterministic). scale_grads
    (torch's): False sums the micro-batches' gradients instead of averaging them.
    """

    RETURNS_OUTPUT = False     # step() returns the mean loss (torch's classes: the output)

    def __init__(self, stages: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 schedule: str | Sequence = "1f1b", recompute: bool = False,
                 scale_grads: bool = True) -> None:
        if type(self) is PipelineSchedule and isinstance(schedule, str) \
                and schedule in TORCH_NAMES:
            warnings.warn(f"PipelineSchedule(..., schedule={schedule!r}) is deprecated: use "
                          f"{TORCH_NAMES[schedule]}(stages, n_microbatches, loss_fn), as "
                          "torch.distributed.pipelining names it", DeprecationWarning,
                          stacklevel=2)
        self.stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not self.stages:
            raise ValueError("PipelineSchedule needs this rank's stage(s)")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        first = self.stages[0]
        self.ctx, self.group = context(), first.group
        p, total = self.group.size, first.num_stages
        if any(s.group != self.group or s.num_stages != total for s in self.stages):
            raise ValueError("this rank's stages must share one group and one num_stages")
        self.by_chunk = {s.chunk: s for s in self.stages}
        virtual = total // p
        if sorted(self.by_chunk) != list(range(virtual)) or len(self.stages) != virtual:
            raise ValueError(f"with {total} stages over {p} ranks, group rank {self.group.rank} "
                             f"holds stages {list(range(self.group.rank, total, p))}, not "
                             f"{sorted(s.stage_index for s in self.stages)}")
        if isinstance(schedule, str):
            if schedule == "naive" and n_microbatches != 1:
                raise ValueError("the naive schedule runs the whole batch at once: "
                                 "n_microbatches=1")
            table = schedules.make_schedule(schedule, p, n_microbatches, virtual)
        else:
            table = [[(str(k).upper(), int(m), int(c)) for k, m, c in ops] for ops in schedule]
            if len(table) != p:
                raise ValueError(f"the schedule has {len(table)} ranks, the group {p}")
        schedules.check_schedule(table, n_microbatches, virtual)
        self.schedule, self.ops = table, table[self.group.rank]
        self.loss_fn, self.n_microbatches, self.recompute = loss_fn, n_microbatches, recompute
        self.scale_grads = scale_grads   # False: the micro-batches' gradients summed, not mean
        self._expected = schedules.messages_to(table, self.group.rank)
        self._inputs = {s.chunk: (s.input_shape, s.input_dtype) for s in self.stages
                        if s.input_shape is not None}
        self._announced = {}              # chunk -> (shape, dtype) of its output, once sent
        self._heard = set()               # chunks whose input header has arrived
        self._exchange = self._vote_on_shapes()

    # --- one step ------------------------------------------------------------------------
    def step(self, *args: torch.Tensor | None, target: torch.Tensor | None = None,
             losses: list | None = None, x: torch.Tensor | None = None):
        """Forward and backward of one batch as n_microbatches micro-batches; the gradients
        accumulate in .grad (zero them before, step the optimizer after).

        args: the batch's inputs to stage 0 (each cut along dim 0 into equal micro-batches),
        passed on the rank holding it and ignored elsewhere; target: on the rank holding the
        last stage. On the last stage's rank, `losses` (a list) gets each micro-batch's loss
        and step returns the mean loss (PipelineSchedule) or, as torch's schedules do, the
        micro-batches' outputs joined along dim 0 (detached); None elsewhere.
        """
        args = tuple(a for a in (args if x is None else (x,) + args) if a is not None)
        has_first = any(s.is_first for s in self.stages)
        has_last = any(s.is_last for s in self.stages)
        inputs = self._split_inputs(args) if has_first else None
        targets = self._split(target, "target") if has_last and target is not None else None
        if has_last and self.loss_fn is None:
            raise ValueError("the last stage needs a loss_fn to start the backward")
        run = _Step(self, inputs, targets)
        for kind, m, c in self.ops:
            (run.forward if kind == "F" else run.backward)(m, self.by_chunk[c])
        run.finish()
        sum_tied_gradients(self.stages, self.group, self.ctx.comm, self.ctx.device)
        if not has_last:
            return None
        step_losses = [run.losses[m] for m in range(self.n_microbatches)]
        if losses is not None:
            losses.extend(step_losses)
        if self.RETURNS_OUTPUT:
            return torch.cat([run.outputs[m] for m in range(self.n_microbatches)])
        return torch.stack(step_losses).mean()

    def _split_inputs(self, args):
        """Each micro-batch's inputs to stage 0: a tuple, one chunk of every argument."""
        if not args:
            raise ValueError("this rank holds the first stage: pass the batch's inputs, "
                             "step(x)")
        chunks = [self._split(a, "x" if len(args) == 1 else f"input {i}")
                  for i, a in enumerate(args)]
        return list(zip(*chunks))

    def _split(self, tensor, name):
        if tensor is None:
            raise ValueError(f"this rank holds the {'first' if name == 'x' else 'last'} stage: "
                             f"pass {name}=")
        if tensor.shape[0] % self.n_microbatches:
            raise ValueError(f"{name} has {tensor.shape[0]} rows, which do not split into "
                             f"{self.n_microbatches} equal micro-batches")
        return tensor.chunk(self.n_microbatches)

    # --- shapes: given, or sent once per boundary --------------------------------------------
    def _vote_on_shapes(self):
        """True when some stage in the group lacks its input shape: then each boundary sends a
        shape header before its first activation. A one-off handshake, not the schedule's
        traffic, so it runs off the record (no comm log, no clock)."""
        known = all(s.is_first or s.input_shape is not None for s in self.stages)
        flag = torch.tensor([int(known)], device=self.ctx.device)
        if self.group.size > 1:
            with self.ctx.off_the_record():
                self.ctx.comm.all_reduce(flag, op="min", group=self.group,
                                         tag="pipeline: shapes given?")
        return not bool(flag.item())

    def _announce(self, stage, y, dst, handles):
        """Before stage's first activation: send its shape (when exchanging); then check that
        later micro-batches keep it (the receiver allocates what was announced)."""
        meta = (tuple(y.shape), y.dtype)
        if stage.chunk in self._announced:
            if self._announced[stage.chunk] != meta:
                raise ValueError(f"stage {stage.stage_index} output changed from "
                                 f"{self._announced[stage.chunk]} to {meta}: every micro-batch "
                                 "must have the same shape")
            return
        self._announced[stage.chunk] = meta
        if stage.output_meta is not None and stage.output_meta != meta:
            raise ValueError(f"stage {stage.stage_index} was given output_args "
                             f"{stage.output_meta}, but its output is {meta}")
        if self._exchange:
            header = torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=self.ctx.device)
            header[0], header[1] = DTYPES.index(y.dtype), y.dim()
            header[2:2 + y.dim()] = torch.tensor(y.shape)
            with self.ctx.off_the_record():
                handles.append(self.ctx.comm.send(header, dst, group=self.group, async_op=True,
                                                  tag="pipeline: shape header"))

    def _input_meta(self, stage, src):
        """(shape, dtype) of one micro-batch's input to `stage`: given, or read from the
        header the previous stage sends before its first activation."""
        given = self._inputs.get(stage.chunk)
        if self._exchange and stage.chunk not in self._heard:
            header = torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=self.ctx.device)
            with self.ctx.off_the_record():
                self.ctx.comm.recv(header, src, group=self.group, tag="pipeline: shape header")
            dims = int(header[1])
            sent = (tuple(int(d) for d in header[2:2 + dims]), DTYPES[int(header[0])])
            if given is not None and given != sent:
                raise ValueError(f"stage {stage.stage_index} was given input {given}, but "
                                 f"stage {stage.stage_index - 1} sends {sent}")
            self._inputs[stage.chunk] = sent
            self._heard.add(stage.chunk)
        return self._inputs[stage.chunk]


class _Step:
    """The state of one `PipelineSchedule.step`: saved activations, messages, losses."""

    def __init__(self, pipe, inputs, targets):
        self.pipe, self.ctx, self.group = pipe, pipe.ctx, pipe.group
        self.inputs, self.targets = inputs, targets
        self.saved, self.local, self.losses, self.outputs = {}, {}, {}, {}
        self.sends, self.headers = [], []
        self.queues = {peer: deque(msgs) for peer, msgs in pipe._expected.items()}
        self.arrived = {}

    def forward(self, m, stage):
        ctx, pipe = self.ctx, self.pipe
        x = self.inputs[m] if stage.is_first else self._receive("act", m, stage)
        if not stage.is_first and x.is_floating_point():
            x.requires_grad_()
        elif stage.is_first and len(x) == 1:
            x = x[0]                    # one input: kept as the tensor (recompute saves it)
        meta = dict(microbatch=m, stage=stage.stage_index, chunk=stage.chunk)
        with ctx.clock.compute("forward", **meta), torch.set_grad_enabled(not pipe.recompute):
            y = self._run(stage, x, m)
        if not stage.is_last:
            self._send("act", m, stage, y.detach())
        self.saved[(m, stage.chunk)] = (x, None if pipe.recompute else y,
                                        (tuple(y.shape), y.dtype))
        if pipe.recompute:
            for name, kept in _kept_inputs(x, m, stage):
                ctx.memory.add_buffer(name, kept)

    def backward(self, m, stage):
        ctx, pipe = self.ctx, self.pipe
        x, y, _ = self.saved[(m, stage.chunk)]
        grad = None if stage.is_last else self._receive("grad", m, stage)
        meta = dict(microbatch=m, stage=stage.stage_index, chunk=stage.chunk)
        with ctx.clock.compute("backward", recompute=pipe.recompute, **meta):
            if pipe.recompute:
                for name, _ in _kept_inputs(x, m, stage):
                    ctx.memory.remove_buffer(name)
                y = self._run(stage, x, m)
            if y.requires_grad:   # a stage with nothing to train and no input grad skips
                torch.autograd.backward(y, grad)
        del self.saved[(m, stage.chunk)]
        if not stage.is_first:
            self._send("grad", m, stage, x.grad if x.grad is not None else torch.zeros_like(x))

    def _run(self, stage, x, m):
        """The stage's forward; on the last stage the loss, divided by M so that the summed
        micro-batch gradients are the full batch's mean-loss gradient."""
        y = stage.module(*x) if isinstance(x, tuple) else stage.module(x)
        if not stage.is_last:
            return y
        self.outputs[m] = y.detach()
        target = None if self.targets is None else self.targets[m]
        loss = self.pipe.loss_fn(y, target) if target is not None else self.pipe.loss_fn(y)
        self.losses[m] = loss.detach()
        return loss / self.pipe.n_microbatches if self.pipe.scale_grads else loss

    def _send(self, kind, m, stage, tensor):
        p = self.group.size
        target = stage.stage_index + (1 if kind == "act" else -1)
        if p == 1:                               # every stage on this rank: hand it over
            self.local[(kind, m, target)] = tensor
            return
        if kind == "act":
            self.pipe._announce(stage, tensor, target % p, self.headers)
        word = "activation" if kind == "act" else "gradient"
        self.sends.append(self.ctx.comm.send(
            tensor, target % p, group=self.group, async_op=True,
            tag=f"pipeline {word} {stage.stage_index}->{target}"))

    def _receive(self, kind, m, stage):
        """This op's message. Messages from a peer come in the order its schedule sends them;
        any that come before they are needed wait in `arrived`."""
        if self.group.size == 1:
            return self.local.pop((kind, m, stage.stage_index)).detach()
        p, key = self.group.size, (kind, m, stage.chunk)
        peer = (stage.stage_index + (-1 if kind == "act" else 1)) % p
        while key not in self.arrived:
            queue = self.queues.get(peer)
            if not queue:
                raise RuntimeError(f"group rank {self.group.rank} needs {kind} of micro-batch "
                                   f"{m} from group rank {peer}, whose schedule never sends it")
            got = queue.popleft()
            chunk = self.pipe.by_chunk[got[2]]
            if got[0] == "act":
                shape, dtype = self.pipe._input_meta(chunk, peer)
            else:
                shape, dtype = self.saved[(got[1], got[2])][2]
            buffer = torch.empty(shape, dtype=dtype, device=self.ctx.device)
            word = "activation" if got[0] == "act" else "gradient"
            source = chunk.stage_index + (-1 if got[0] == "act" else 1)
            self.arrived[got] = self.ctx.comm.recv(
                buffer, peer, group=self.group,
                tag=f"pipeline {word} {source}->{chunk.stage_index}")
        return self.arrived.pop(key)

    def finish(self):
        for handle in self.sends:
            handle.wait()
        with self.ctx.off_the_record():
            for handle in self.headers:
                handle.wait()


def _kept_inputs(x, m, stage):
    """(name, tensor) of the stage inputs recompute keeps for micro-batch m (memory ledger)."""
    kept = x if isinstance(x, tuple) else (x,)
    return [(f"stage input {m}.{stage.chunk}" + (f".{i}" if i else ""), t)
            for i, t in enumerate(kept)]


# --- torch.distributed.pipelining's classes: each names its schedule for the one executor ------

class ScheduleGPipe(PipelineSchedule):
    """torch's ScheduleGPipe(stage, n_microbatches, loss_fn): every forward, then every
    backward. step() returns the last stage's output, as torch's does."""
    SCHEDULE, RETURNS_OUTPUT = "gpipe", True

    def __init__(self, stage: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, *, scale_grads: bool = True,
                 recompute: bool = False) -> None:
        super().__init__(stage, n_microbatches, loss_fn, schedule=self.SCHEDULE,
                         recompute=recompute, scale_grads=scale_grads)


class Schedule1F1B(ScheduleGPipe):
    """torch's Schedule1F1B: after a warm-up of P - r forwards, one forward, one backward."""
    SCHEDULE = "1f1b"


class ScheduleInterleaved1F1B(ScheduleGPipe):
    """torch's ScheduleInterleaved1F1B(stages, ...): this rank's stages r, r + P, ... (V per
    rank), 1F1B over the chunks (Narayanan et al. 2021)."""
    SCHEDULE = "interleaved"


TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
               "interleaved": "ScheduleInterleaved1F1B"}
