"""Zero-bubble pipeline execution: the backward split into B (input gradient) and W (weight
gradient), run by any split schedule, e.g. ZB-H1 (Qi et al. 2023, arXiv 2401.10241).

Idea. The next stage upstream waits only for B, the gradient of this stage's input; W, the
gradient of this stage's weights, is needed by nobody until the optimizer step. So B runs as
soon as the output gradient arrives and is sent on at once, and each W waits for a slot in
which the rank would otherwise idle. ZB-H1 idles (P-1)(T_F + T_B - T_W) per rank instead of
1F1B's (P-1)(T_F + T_B + T_W), with 1F1B's peak activation memory (labkit.theory.pipeline).

How B and W split in autograd: B walks the graph from the output back to the input only, and
keeps, at each layer with weights, the gradient of that layer's output; W then multiplies
those by the layer's saved inputs (dW = dY^T X), nothing else: B + W cost one backward. labkit
uses PyTorch's own split for this (`torch.distributed.pipelining._backward`: private, so with
a fallback: B by `torch.autograd.grad(y, x, dy, retain_graph=True)`, W by
`torch.autograd.backward(y, dy, inputs=weights)`, which walks the graph again).
Communication is 1F1B's: per micro-batch, one activation forward and one gradient back per
stage boundary, point to point; W sends nothing.

    stage = PipelineStage(stages[rank], rank, P, device, input_args=torch.empty(mb, hidden))
    pipe = ScheduleInterleavedZeroBubble(stage, n_microbatches=8, loss_fn=loss_fn)   # ZB-H1
    output = pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)

`ScheduleInterleavedZeroBubble` has torch's name and argument order, with one stage per rank
(V = 1, where torch's interleaves V >= 1 stages per rank: more is refused here);
`ZeroBubbleSchedule(stage, loss_fn, n_microbatches, schedule=)` runs any split schedule given as
data (with "zb-h1", a deprecated spelling of the torch-named class).

torch.distributed.pipelining's own zero-bubble orders (ScheduleZBVZeroBubble, ScheduleDualPipeV,
two stages per rank in a V) are read as labkit data by `torch_order`, to be replayed and
compared (labkit.theory.pipeline_layouts; bench/zero_bubble.py times torch's against ZB-H1).
"""
import warnings

import torch

from ..runtime import torch_compat
from ..runtime.context import context
from ..theory import pipeline as schedules

# PyTorch's B/W split (what its ScheduleZBVZeroBubble runs); (None, None) on a torch without it:
# the walk-again fallback below
stage_backward_input, stage_backward_weight = torch_compat.pipelining_backward()


class ZeroBubbleSchedule:
    """Runs a split schedule (ops F, B, W) over this rank's one `PipelineStage` (V = 1).

    schedule: "zb-h1" or the data (for every group rank, its ops ("F"|"B"|"W", micro-batch, 0)),
    checked before anything runs. Every stage but the first needs its `input_shape` (one
    micro-batch's input) and `input_dtype`, so that nothing but the schedule's traffic flows.
    """

    RETURNS_OUTPUT = False     # step() returns the mean loss (torch's class: the output)

    def __init__(self, stage, loss_fn, n_microbatches, schedule="zb-h1"):
        if type(self) is ZeroBubbleSchedule and isinstance(schedule, str):
            warnings.warn("ZeroBubbleSchedule(stage, loss_fn, n_microbatches) is deprecated: "
                          "use ScheduleInterleavedZeroBubble(stage, n_microbatches, loss_fn), "
                          "torch's name and order", DeprecationWarning, stacklevel=2)
        self.stage, self.ctx, self.group = stage, context(), stage.group
        p = self.group.size
        if stage.num_stages != p:
            raise ValueError(f"ZeroBubbleSchedule runs one stage per rank: {stage.num_stages} "
                             f"stages over {p} ranks")
        if not stage.is_first and stage.input_shape is None:
            raise ValueError(f"stage {stage.stage_index} needs input_shape= (or torch's "
                             "input_args=: one micro-batch's input) for the zero-bubble "
                             "executor")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        if schedule == "zb-h1":
            schedule = schedules.zb_h1_schedule(p, n_microbatches)
        elif isinstance(schedule, str):
            raise ValueError(f"schedule must be 'zb-h1' or a split schedule's data, not "
                             f"{schedule!r}")
        table = [[(str(k).upper(), int(m), int(c)) for k, m, c in ops] for ops in schedule]
        if len(table) != p or not schedules.is_split(table):
            raise ValueError(f"need a split schedule (with W ops) for {p} ranks")
        schedules.check_schedule(table, n_microbatches, 1)
        self.schedule, self.ops = table, table[self.group.rank]
        self.loss_fn, self.n_microbatches = loss_fn, n_microbatches

    def step(self, *args, target=None, losses=None, x=None):
        """Forward, B and W of every micro-batch, in the schedule's order; the weight
        gradients accumulate in .grad. args: stage 0's inputs. On the last stage returns the
        mean loss (the torch-named class: the outputs joined along dim 0), else None."""
        stage, m_total = self.stage, self.n_microbatches
        args = tuple(a for a in (args if x is None else (x,) + args) if a is not None)
        inputs = list(zip(*[_split(a, m_total, "x", "first") for a in args])) or \
            _split(None, m_total, "x", "first") if stage.is_first else None
        targets = _split(target, m_total, "target", "last") if stage.is_last else None
        saved, pending, sends, step_losses, self._outputs = {}, {}, [], {}, {}
        for kind, m, _ in self.ops:
            meta = dict(microbatch=m, stage=stage.stage_index, chunk=0)
            if kind == "F":
                saved[m] = self._forward(m, inputs, targets, step_losses, sends, meta)
            elif kind == "B":
                pending[m] = self._input_grad(saved[m], sends, meta)
            else:
                self._weight_grad(saved.pop(m), pending.pop(m), meta)
        for handle in sends:
            handle.wait()
        if not stage.is_last:
            return None
        ordered = [step_losses[m] for m in range(m_total)]
        if losses is not None:
            losses.extend(ordered)
        if self.RETURNS_OUTPUT:
            return torch.cat([self._outputs.pop(m) for m in range(m_total)])
        return torch.stack(ordered).mean()

    # --- the three ops ----------------------------------------------------------------------
    def _forward(self, m, inputs, targets, step_losses, sends, meta):
        stage, comm = self.stage, self.ctx.comm
        if stage.is_first:
            x = inputs[m]
        else:
            x = comm.recv(torch.empty(stage.input_shape, dtype=stage.input_dtype,
                                      device=self.ctx.device), stage.stage_index - 1,
                          group=self.group, tag=f"pipeline activation {stage.stage_index - 1}"
                                                f"->{stage.stage_index}")
            if x.is_floating_point():
                x.requires_grad_()
        with self.ctx.clock.compute("forward", **meta):
            y = stage.module(*x) if stage.is_first else stage.module(x)
            if stage.is_last:
                self._outputs[m] = y.detach()
                loss = self.loss_fn(y, targets[m])
                step_losses[m] = loss.detach()
                y = loss / self.n_microbatches      # summed over micro-batches: the mean
        if not stage.is_last:
            sends.append(comm.send(y.detach(), stage.stage_index + 1, group=self.group,
                                   async_op=True, tag=f"pipeline activation "
                                   f"{stage.stage_index}->{stage.stage_index + 1}"))
        return x, y

    def _input_grad(self, saved, sends, meta):
        """B: the output's gradient (received; the loss's own on the last stage), then the
        input's, sent on. Returns what W needs. The first stage has no input gradient to
        compute: its W runs the whole backward to its weights."""
        stage, comm = self.stage, self.ctx.comm
        x, y = saved
        dy = None if stage.is_last else comm.recv(
            torch.empty_like(y), stage.stage_index + 1, group=self.group,
            tag=f"pipeline gradient {stage.stage_index + 1}->{stage.stage_index}")
        weights = [q for q in stage.parameters() if q.requires_grad]
        needs_dx = not stage.is_first and x.requires_grad and y.requires_grad
        groups = None
        with self.ctx.clock.compute("backward", **meta):
            if stage_backward_input is not None and needs_dx:
                dxs, groups = stage_backward_input([y], None if dy is None else [dy],
                                                   [x] if needs_dx else [], iter(weights))
                dx = dxs[0] if needs_dx else None
            elif needs_dx:
                dx = torch.autograd.grad(y, x, dy, retain_graph=True)[0]
            else:
                dx = None
        if not stage.is_first:
            sends.append(comm.send(dx if dx is not None else torch.zeros_like(x),
                                   stage.stage_index - 1, group=self.group, async_op=True,
                                   tag=f"pipeline gradient {stage.stage_index}->"
                                       f"{stage.stage_index - 1}"))
        return dy, groups

    def _weight_grad(self, saved, pending, meta):
        """W: the weights' gradients from what B kept (accumulated in .grad)."""
        _, y = saved
        dy, groups = pending
        weights = [q for q in self.stage.parameters() if q.requires_grad]
        with self.ctx.clock.compute("weight grad", **meta):
            if groups is not None:
                stage_backward_weight(iter(weights), groups)
            elif weights and y.requires_grad:
                torch.autograd.backward(y, dy, inputs=weights)


class ScheduleInterleavedZeroBubble(ZeroBubbleSchedule):
    """torch's ScheduleInterleavedZeroBubble(stages, n_microbatches, loss_fn), run as ZB-H1 on
    one stage per rank (a list of one is taken; more stages per rank are refused)."""
    RETURNS_OUTPUT = True

    def __init__(self, stages, n_microbatches, loss_fn=None):
        if isinstance(stages, (list, tuple)):
            if len(stages) != 1:
                raise ValueError(f"ScheduleInterleavedZeroBubble: labkit's split executor runs "
                                 f"one stage per rank, not {len(stages)} (interleaved: V = 1)")
            stages = stages[0]
        super().__init__(stages, loss_fn, n_microbatches, schedule="zb-h1")


def _split(tensor, n, name, which):
    if tensor is None:
        raise ValueError(f"this rank holds the {which} stage: pass {name}=")
    if tensor.shape[0] % n:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, which do not split into {n} "
                         "equal micro-batches")
    return tensor.chunk(n)


# ------------------------------------------------------------ torch's orders, as labkit data

TORCH_V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def torch_actions(name, stages, microbatches):
    """torch.distributed.pipelining's own order for `name` (one of TORCH_V_SCHEDULES, two
    stages per rank in a V), P = `stages` ranks and M micro-batches: per rank its list of
    actions (e.g. `0F3`, `7I0`, `(0F7;7B3)OVERLAP_F_B`), computed as every rank computes it at
    construction, here without ranks or a process group (torch's private
    `_calculate_single_rank_operations`, through runtime/torch_compat.py)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    if name not in TORCH_V_SCHEDULES:
        raise ValueError(f"name must be one of {TORCH_V_SCHEDULES}, not {name!r}")
    kind = getattr(torch_schedules, name, None)
    actions = None if kind is None else torch_compat.pipeline_actions(kind, stages, microbatches)
    if actions is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no {name} order that labkit "
                           "can read: compare labkit's own orders (ZB-H1, DualPipe) instead")
    return actions


def readable_torch_orders():
    """The names in TORCH_V_SCHEDULES whose order this torch lets labkit read; each of the
    others is said in one line (a warning) and left out of a comparison."""
    import warnings

    readable = []
    for name in TORCH_V_SCHEDULES:
        try:
            torch_actions(name, 2, 4)
            readable.append(name)
        except (RuntimeError, ImportError) as why:
            warnings.warn(f"{name} left out: {why}", RuntimeWarning, stacklevel=2)
    return readable


def torch_order(name, stages, microbatches):
    """`torch_actions` as a `labkit.theory.pipeline_layouts.LaidOut` on the "v" layout
    (torch's I: B; its full backward B: a slot B, W; its OVERLAP_F_B: a slot F, B, W)."""
    from ..theory.pipeline_layouts import LaidOut

    ops, slots = [], []
    for rank, actions in enumerate(torch_actions(name, stages, microbatches)):
        mine, spans = [], []

        def add(action, rank=rank, mine=mine):
            chunk = 0 if action.stage_index == rank else 1     # the V: r and 2P-1-r
            kind = action.computation_type.value
            op = (kind if kind in "FW" else "B", action.microbatch_index, chunk)
            mine.extend([op, ("W",) + op[1:]] if kind == "B" else [op])
            return 2 if kind == "B" else 1

        for action in actions:
            start = len(mine)
            n = sum(add(sub) for sub in action.sub_actions or [action])
            if n > 1:                      # a full backward, or (F; B) overlapped
                spans.append((start, n))
        ops.append(mine)
        slots.append(tuple(spans))
    return LaidOut(ops, "v", microbatches, 2, tuple(slots))
