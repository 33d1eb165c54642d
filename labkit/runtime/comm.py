"""The only place that calls torch.distributed collectives; every call is logged and timed.

Each record: op, group size, payload bytes (the tensor this rank handed in), the bytes this
rank sends on the wire for the ring algorithm (all_reduce 2(n-1)/n S, all_gather and
reduce_scatter (n-1)/n of the full tensor), wall seconds, and modelled seconds on the clock.
"""
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..theory import time as theory_time

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.SUM}  # gloo has no AVG: sum, then divide by the group size


@dataclass
class CommRecord:
    op: str
    group_size: int
    dtype: str
    bytes: int
    wire_bytes_per_rank: float
    wall_s: float
    modelled_s: float
    async_op: bool
    tag: str = ""
    peer: int = -1


@dataclass
class Handle:
    """What an async collective returns: `wait()` finishes it and returns the result tensor."""
    comm: object
    work: object
    result: torch.Tensor
    record: CommRecord
    started: float
    finish: object = None           # a function run once the data is there (e.g. divide for avg)
    timing: object = None           # the clock's note of when this op was issued
    done: bool = field(default=False)

    def wait(self):
        if not self.done:
            if self.work is not None:
                self.comm.ctx.set_status(f"waiting in async {self.record.op} (group of "
                                         f"{self.record.group_size}) {self.record.tag}")
                self.work.wait()
            if self.finish is not None:
                self.finish()
            self.record.wall_s = time.perf_counter() - self.started
            self.record.modelled_s = self.comm.ctx.clock.finish_async(self.timing)
            self.comm.ctx.set_status("")
            self.done = True
        return self.result


class Comm:
    def __init__(self, ctx):
        self.ctx = ctx
        self.records = []
        self.tag = ""  # a label the technique sets (e.g. "grad bucket 3"), kept in each record

    # --- collectives -------------------------------------------------------------------
    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        """Reduce `tensor` in place over the group (sum, avg, max, min)."""
        group = group or self.ctx.world
        finish = (lambda: tensor.div_(group.size)) if op == "avg" else None
        return self._run("all_reduce", tensor, tensor, group, async_op, finish,
                         lambda: dist.all_reduce(tensor, _REDUCE_OPS[op], group=group.pg,
                                                 async_op=async_op))

    def all_gather(self, tensor, group=None, async_op=False):
        """Concatenate every rank's `tensor` along dim 0; returns a new tensor (n x larger)."""
        group = group or self.ctx.world
        tensor = tensor.contiguous()
        out = tensor.new_empty((group.size * tensor.shape[0],) + tuple(tensor.shape[1:]))
        return self._run("all_gather", tensor, out, group, async_op, None,
                         lambda: dist.all_gather_single(out, tensor, group=group.pg,
                                                        async_op=async_op))

    def reduce_scatter(self, tensor, op="sum", group=None, async_op=False):
        """Reduce `tensor` over the group; this rank keeps its 1/n slice of dim 0."""
        group = group or self.ctx.world
        tensor = tensor.contiguous()
        if tensor.shape[0] % group.size:
            raise ValueError(f"reduce_scatter: dim 0 ({tensor.shape[0]}) must divide by the "
                             f"group size ({group.size}); pad the tensor first")
        out = tensor.new_empty((tensor.shape[0] // group.size,) + tuple(tensor.shape[1:]))
        finish = (lambda: out.div_(group.size)) if op == "avg" else None
        return self._run("reduce_scatter", tensor, out, group, async_op, finish,
                         lambda: dist.reduce_scatter_single(out, tensor, _REDUCE_OPS[op],
                                                            group=group.pg, async_op=async_op))

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        """Copy `tensor` from global rank `src` to every rank of the group, in place."""
        group = group or self.ctx.world
        return self._run("broadcast", tensor, tensor, group, async_op, None,
                         lambda: dist.broadcast(tensor, src, group=group.pg, async_op=async_op))

    def all_to_all(self, tensor, input_splits=None, output_splits=None, group=None,
                   async_op=False):
        """Send slice i of dim 0 to rank i of the group; returns what every rank sent here.

        Without splits the slices are equal. With `input_splits` but no `output_splits`, the
        sizes are exchanged first (one small all_to_all, logged too).
        """
        group = group or self.ctx.world
        tensor = tensor.contiguous()
        if input_splits is not None and output_splits is None:
            sizes = torch.tensor(input_splits, dtype=torch.int64)
            output_splits = self.all_to_all(sizes, group=group).tolist()
        rows = sum(output_splits) if output_splits is not None else tensor.shape[0]
        out = tensor.new_empty((rows,) + tuple(tensor.shape[1:]))
        return self._run("all_to_all", tensor, out, group, async_op, None,
                         lambda: dist.all_to_all_single(out, tensor, output_splits,
                                                        input_splits, group=group.pg,
                                                        async_op=async_op))

    def barrier(self, group=None):
        group = group or self.ctx.world
        return self._run("barrier", torch.empty(0), None, group, False, None,
                         lambda: dist.barrier(group=group.pg))

    # --- point to point ------------------------------------------------------------------
    def send(self, tensor, dst, async_op=False):
        """Send `tensor` to global rank `dst`; the sender's virtual time travels with it."""
        timing = self.ctx.clock.start_send(dst, tensor.nbytes)
        issued = timing.issued if timing is not None else 0.0  # None: the clock is off
        stamp = torch.tensor([issued], dtype=torch.float64, device=self.ctx.device)
        record = self._record("send", tensor, 2, dst)
        t0 = time.perf_counter()
        self.ctx.set_status(f"send to rank {dst} ({tensor.nbytes} bytes) {self.tag}")
        if async_op:
            works = [dist.isend(stamp, dst), dist.isend(tensor.contiguous(), dst)]
            return Handle(self, _Works(works), tensor, record, t0, timing=timing)
        dist.send(stamp, dst)
        dist.send(tensor.contiguous(), dst)
        self.ctx.set_status("")
        record.wall_s = time.perf_counter() - t0
        record.modelled_s = self.ctx.clock.finish_async(timing)
        return tensor

    def recv(self, tensor, src, async_op=False):
        """Receive into `tensor` from global rank `src`; waits (virtually) for its arrival."""
        stamp = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        record = self._record("recv", tensor, 2, src)
        t0 = time.perf_counter()
        self.ctx.set_status(f"recv from rank {src} ({tensor.nbytes} bytes) {self.tag}")
        if async_op:
            works = [dist.irecv(stamp, src), dist.irecv(tensor, src)]
            timing = self.ctx.clock.start_recv(src, tensor.nbytes, stamp)
            return Handle(self, _Works(works), tensor, record, t0, timing=timing)
        dist.recv(stamp, src)
        dist.recv(tensor, src)
        self.ctx.set_status("")
        record.wall_s = time.perf_counter() - t0
        record.modelled_s = self.ctx.clock.finish_async(
            self.ctx.clock.start_recv(src, tensor.nbytes, stamp))
        return tensor

    # --- the log ---------------------------------------------------------------------------
    def dataframe(self):
        """Every call as a row (pandas DataFrame)."""
        import pandas as pd
        return pd.DataFrame([r.__dict__ for r in self.records])

    def summary(self):
        """One row per op: calls, payload bytes, wire bytes per rank, wall and modelled seconds."""
        rows = {}
        for r in self.records:
            row = rows.setdefault(r.op, dict(op=r.op, calls=0, bytes=0, wire_bytes_per_rank=0.0,
                                             wall_s=0.0, modelled_s=0.0))
            row["calls"] += 1
            row["bytes"] += r.bytes
            row["wire_bytes_per_rank"] += r.wire_bytes_per_rank
            row["wall_s"] += r.wall_s
            row["modelled_s"] += r.modelled_s
        return list(rows.values())

    def wire_bytes(self, op=None):
        """Bytes this rank sent on the wire, for one op or all of them."""
        return sum(r.wire_bytes_per_rank for r in self.records if op in (None, r.op))

    def reset(self):
        self.records.clear()

    # --- one place that runs and logs a collective -------------------------------------------
    def _record(self, op, tensor, group_size, peer=-1):
        record = CommRecord(op, group_size, str(tensor.dtype).replace("torch.", ""),
                            tensor.nbytes,
                            theory_time.wire_bytes_per_rank(op, tensor.nbytes, group_size),
                            0.0, 0.0, False, self.tag, peer)
        self.records.append(record)
        return record

    def _run(self, op, tensor, result, group, async_op, finish, call):
        record = self._record(op, tensor, group.size)
        record.async_op = async_op
        timing = self.ctx.clock.start_collective(op, tensor.nbytes, group, async_op)
        self.ctx.set_status(f"{op} (group {list(group.ranks)}, {tensor.nbytes} bytes, "
                            f"call #{len(self.records)}) {self.tag}")
        t0 = time.perf_counter()
        work = call()
        handle = Handle(self, work, result, record, t0, finish=finish, timing=timing)
        if async_op:
            return handle
        handle.work = None  # the sync call already finished
        return handle.wait()


@dataclass
class _Works:
    """Several works waited as one (a p2p message is its time stamp plus its tensor)."""
    works: list

    def wait(self):
        for w in self.works:
            w.wait()
