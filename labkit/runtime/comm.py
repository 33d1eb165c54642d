"""The only place that calls torch.distributed collectives; every call is logged and timed.

What each call records (op, group, tag, bytes measured and modelled, seconds) and the totals
and tables read from them: comm_log.py (`CommLog`, which `Comm` extends).

Every op takes `group=` (None: the world; a labkit Group; or a torch ProcessGroup) and `tag=`
(a label kept in the log, e.g. "grad bucket 3"). Point-to-point peers are ranks *of the group*.

Each op sends its own tensor's bytes and nothing else: the virtual clock is told when an op
is issued and when it is waited for (`ctx.clock`, clock.py) and learns the peers' issue times
from the run's key-value store, beside the ops.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Union

import torch
import torch.distributed as dist

from .comm_log import CommLog, CommRecord

# what `group=` takes: a runtime.context Group, a torch ProcessGroup, or None (the world); named
# here, not imported from context.py (which imports this module)
GroupLike = Union[object, dist.ProcessGroup, None]

ReduceOpName = Literal["sum", "avg", "max", "min"]   # what `op=` takes


def dist_op(name, older):
    """torch.distributed's `name`, or the same collective under the `older` name it had before
    torch 2.13 (all_gather_single was all_gather_into_tensor, reduce_scatter_single was
    reduce_scatter_tensor; the same arguments): the lab also runs on a GPU machine's torch."""
    return getattr(dist, name, None) or getattr(dist, older)


def _all_gather_op():   # looked up at each call: a test may take the new name away
    return dist_op("all_gather_single", "all_gather_into_tensor")

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.SUM}  # gloo has no AVG: sum, then divide by the group size


@dataclass
class Handle:
    """What an async collective returns: `wait()` finishes it and returns the result tensor."""
    comm: object
    work: object
    result: torch.Tensor
    record: CommRecord
    started: float
    finish: object = None           # run once the data is there (divide for avg)
    timing: object = None           # the clock's note of when this op was issued
    done: bool = field(default=False)

    def wait(self) -> torch.Tensor:
        if not self.done:
            self._complete()
            self.comm._finished(self.record, time.perf_counter() - self.started,
                                self.comm.ctx.clock.finish_async(self.timing))
            self.done = True
        return self.result

    def _complete(self):
        """Wait for the data and unpack it (once; the clock may call it before `wait`)."""
        if self.work is not None:
            ctx = self.comm.ctx
            if ctx._status is not None:
                ctx.set_status(f"waiting in async {self.record.op} (group of "
                               f"{self.record.group_size}) {self.record.tag}")
            self.work.wait()
            self.work = None
            if ctx._status is not None:
                ctx.set_status("")
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


class Comm(CommLog):
    """The collectives and messages of one rank (the log they keep: `CommLog`)."""

    def __init__(self, ctx) -> None:   # ctx: the rank's runtime Context
        super().__init__()
        self.ctx = ctx

    # --- collectives -------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum", group: GroupLike = None,
                   async_op: bool = False, tag: str = "") -> torch.Tensor | Handle:
        """Reduce `tensor` in place over the group (sum, avg, max, min)."""
        group = self.ctx.group(group)
        return self._reduce("all_reduce", tensor, tensor, op, group, async_op, tag)

    def all_gather(self, tensor: torch.Tensor, group: GroupLike = None, async_op: bool = False,
                   tag: str = "") -> torch.Tensor | Handle:
        """Concatenate every rank's `tensor` along dim 0; returns a new tensor (n x larger)."""
        group = self.ctx.group(group)
        # Only the values travel (the result is a new tensor outside autograd): gloo copies
        # through views of the input, which a tensor that requires grad would refuse.
        tensor = tensor.detach().contiguous()
        out = tensor.new_empty((group.size * tensor.shape[0],) + tuple(tensor.shape[1:]))
        record, timing = self._start("all_gather", tensor, group, async_op, tag)
        return self._issue(record, timing, group, out, None, async_op, lambda: (
            _all_gather_op()(out, tensor, group=group.pg, async_op=async_op)))

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOpName = "sum",
                       group: GroupLike = None, async_op: bool = False,
                       tag: str = "") -> torch.Tensor | Handle:
        """Reduce `tensor` over the group; this rank keeps its 1/n slice of dim 0."""
        group = self.ctx.group(group)
        tensor = tensor.detach().contiguous()
        if tensor.shape[0] % group.size:
            raise ValueError(f"reduce_scatter: dim 0 ({tensor.shape[0]}) must divide by the "
                             f"group size ({group.size}); pad the tensor first")
        out = tensor.new_empty((tensor.shape[0] // group.size,) + tuple(tensor.shape[1:]))
        return self._reduce("reduce_scatter", tensor, out, op, group, async_op, tag)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: GroupLike = None,
                  async_op: bool = False, tag: str = "") -> torch.Tensor | Handle:
        """Copy `tensor` from the group's member `src` (a rank of the group) to every member."""
        group = self.ctx.group(group)
        root = group.global_rank(src)
        record, timing = self._start("broadcast", tensor, group, async_op, tag)
        return self._issue(record, timing, group, tensor, None, async_op, lambda: (
            dist.broadcast(tensor, root, group=group.pg, async_op=async_op)))

    def all_to_all(self, tensor: torch.Tensor, input_splits: Sequence[int] | None = None,
                   output_splits: Sequence[int] | None = None, group: GroupLike = None,
                   async_op: bool = False, tag: str = "") -> torch.Tensor | Handle:
        """Send slice i of dim 0 to rank i of the group; returns what every rank sent here.

        Without splits the slices are equal. With `input_splits` but no `output_splits`, the
        sizes are exchanged first (one small all_to_all, logged too).
        """
        group = self.ctx.group(group)
        tensor = tensor.detach().contiguous()
        if input_splits is not None and output_splits is None:
            sizes = torch.tensor(input_splits, dtype=torch.int64, device=tensor.device)
            output_splits = self.all_to_all(sizes, group=group, tag=f"{tag} sizes").tolist()
        rows = sum(output_splits) if output_splits is not None else tensor.shape[0]
        out = tensor.new_empty((rows,) + tuple(tensor.shape[1:]))
        if input_splits is None and tensor.shape[0] % group.size:
            raise ValueError(f"all_to_all: dim 0 ({tensor.shape[0]}) must divide by the group "
                             f"size ({group.size}) when no splits are given")
        record, timing = self._start("all_to_all", tensor, group, async_op, tag)
        return self._issue(record, timing, group, out, None, async_op, lambda: (
            dist.all_to_all_single(out, tensor, output_splits, input_splits,
                                   group=group.pg, async_op=async_op)))

    def barrier(self, group: GroupLike = None, tag: str = "") -> None:
        group = self.ctx.group(group)
        record, timing = self._start("barrier", torch.empty(0), group, False, tag)
        self._issue(record, timing, group, None, None, False,
                    lambda: dist.barrier(group=group.pg))

    # --- point to point ------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, group: GroupLike = None, async_op: bool = False,
             tag: str = "") -> torch.Tensor | Handle:
        """Send `tensor` to member `dst` of the group (the world: a global rank)."""
        peer = self.ctx.group(group).global_rank(dst)
        timing = self.ctx.clock.start_send(peer, tensor.nbytes)
        record = self._record("send", tensor, (self.ctx.rank, peer), tag, peer)
        data = tensor.contiguous()
        t0 = time.perf_counter()
        if async_op:
            return Handle(self, dist.isend(data, peer), tensor, record, t0, timing=timing)
        self._status(f"send to rank {peer} ({tensor.nbytes} bytes) {tag}")
        dist.send(data, peer)
        self._status("")
        self._finished(record, time.perf_counter() - t0, self.ctx.clock.finish_async(timing))
        return tensor

    def recv(self, tensor: torch.Tensor, src: int, group: GroupLike = None, async_op: bool = False,
             tag: str = "") -> torch.Tensor | Handle:
        """Receive into `tensor` from member `src` of the group; waits (virtually) for it."""
        peer = self.ctx.group(group).global_rank(src)
        record = self._record("recv", tensor, (peer, self.ctx.rank), tag, peer)
        timing = self.ctx.clock.start_recv(peer, tensor.nbytes)
        target = tensor if tensor.is_contiguous() else torch.empty_like(
            tensor, memory_format=torch.contiguous_format)
        finish = None if target is tensor else (lambda: tensor.copy_(target))
        t0 = time.perf_counter()
        if async_op:
            return Handle(self, dist.irecv(target, peer), tensor, record, t0, finish=finish,
                          timing=timing)
        self._status(f"recv from rank {peer} ({tensor.nbytes} bytes) {tag}")
        dist.recv(target, peer)
        self._status("")
        if finish is not None:
            finish()
        self._finished(record, time.perf_counter() - t0, self.ctx.clock.finish_async(timing))
        return tensor

    # --- one place that runs and logs a collective -------------------------------------------
    def _start(self, op, tensor, group, async_op, tag):
        record = self._record(op, tensor, group.ranks, tag)
        record.async_op = async_op
        return record, self.ctx.clock.start_collective(op, tensor.nbytes, group, async_op)

    def _issue(self, record, timing, group, result, finish, async_op, call):
        """Run `call` (the torch.distributed op); finish it now, or hand back a Handle."""
        self.ctx.collectives += 1
        if not async_op:
            self._status(f"{record.op} (group {list(group.ranks)}, {record.bytes} bytes) "
                         f"{record.tag}")
        t0 = time.perf_counter()
        work = call()
        handle = Handle(self, work if async_op else None, result, record, t0, finish=finish,
                        timing=timing)
        if timing is not None and timing.group_ready is None:
            timing.complete = handle._complete   # the clock waits for the data before the posts
        if async_op:
            return handle
        self._status("")
        return handle.wait()

    def _reduce(self, name, tensor, out, op, group, async_op, tag):
        """all_reduce (out is tensor) or reduce_scatter (out is this member's piece)."""
        record, timing = self._start(name, tensor, group, async_op, tag)
        reduce_op = _REDUCE_OPS[op]
        finish = (lambda: out.div_(group.size)) if op == "avg" else None
        if name == "reduce_scatter":
            return self._issue(record, timing, group, out, finish, async_op, lambda: (
                dist_op("reduce_scatter_single", "reduce_scatter_tensor")(
                    out, tensor, reduce_op, group=group.pg, async_op=async_op)))
        return self._issue(record, timing, group, out, finish, async_op, lambda: (
            dist.all_reduce(tensor, reduce_op, group=group.pg, async_op=async_op)))

    def _status(self, text):
        if self.ctx._status is not None:
            self.ctx.set_status(text)

