"""The only place that calls torch.distributed collectives; every call is logged and timed.

Each record: op, group, tag, payload bytes (the tensor this rank handed in, measured), the
ring-model bytes this rank would send on the wire (all_reduce 2(n-1)/n S, all_gather and
reduce_scatter (n-1)/n of the full tensor: *modelled*, gloo does not report its own), wall
seconds (measured) and modelled seconds on the clock. The log keeps running totals per
(op, group, tag) and only the last `KEEP_RECORDS` single calls, so a long run does not grow it.

Every op takes `group=` (None: the world; a labkit Group; or a torch ProcessGroup) and `tag=`
(a label kept in the log, e.g. "grad bucket 3"). Point-to-point peers are ranks *of the group*.
"""
import time
from collections import deque
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
    group: str = ""


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
            self.comm._finished(self.record, time.perf_counter() - self.started,
                                self.comm.ctx.clock.finish_async(self.timing))
            self.comm.ctx.set_status("")
            self.done = True
        return self.result


KEEP_RECORDS = 10_000   # single calls kept for inspection; totals are kept for every call


class Comm:
    def __init__(self, ctx):
        self.ctx = ctx
        self.records = deque(maxlen=KEEP_RECORDS)
        self.totals = {}        # (op, group, tag) -> calls, bytes, wire bytes, seconds
        self.recording = True   # False inside ctx.off_the_record()

    # --- collectives -------------------------------------------------------------------
    def all_reduce(self, tensor, op="sum", group=None, async_op=False, tag=""):
        """Reduce `tensor` in place over the group (sum, avg, max, min)."""
        group = self.ctx.group(group)
        finish = (lambda: tensor.div_(group.size)) if op == "avg" else None
        return self._run("all_reduce", tensor, tensor, group, async_op, finish, tag,
                         lambda: dist.all_reduce(tensor, _REDUCE_OPS[op], group=group.pg,
                                                 async_op=async_op))

    def all_gather(self, tensor, group=None, async_op=False, tag=""):
        """Concatenate every rank's `tensor` along dim 0; returns a new tensor (n x larger)."""
        group = self.ctx.group(group)
        tensor = tensor.contiguous()
        out = tensor.new_empty((group.size * tensor.shape[0],) + tuple(tensor.shape[1:]))
        return self._run("all_gather", tensor, out, group, async_op, None, tag,
                         lambda: dist.all_gather_single(out, tensor, group=group.pg,
                                                        async_op=async_op))

    def reduce_scatter(self, tensor, op="sum", group=None, async_op=False, tag=""):
        """Reduce `tensor` over the group; this rank keeps its 1/n slice of dim 0."""
        group = self.ctx.group(group)
        tensor = tensor.contiguous()
        if tensor.shape[0] % group.size:
            raise ValueError(f"reduce_scatter: dim 0 ({tensor.shape[0]}) must divide by the "
                             f"group size ({group.size}); pad the tensor first")
        out = tensor.new_empty((tensor.shape[0] // group.size,) + tuple(tensor.shape[1:]))
        finish = (lambda: out.div_(group.size)) if op == "avg" else None
        return self._run("reduce_scatter", tensor, out, group, async_op, finish, tag,
                         lambda: dist.reduce_scatter_single(out, tensor, _REDUCE_OPS[op],
                                                            group=group.pg, async_op=async_op))

    def broadcast(self, tensor, src=0, group=None, async_op=False, tag=""):
        """Copy `tensor` from the group's member `src` (a rank of the group) to every member."""
        group = self.ctx.group(group)
        root = group.global_rank(src)
        return self._run("broadcast", tensor, tensor, group, async_op, None, tag,
                         lambda: dist.broadcast(tensor, root, group=group.pg, async_op=async_op))

    def all_to_all(self, tensor, input_splits=None, output_splits=None, group=None,
                   async_op=False, tag=""):
        """Send slice i of dim 0 to rank i of the group; returns what every rank sent here.

        Without splits the slices are equal. With `input_splits` but no `output_splits`, the
        sizes are exchanged first (one small all_to_all, logged too).
        """
        group = self.ctx.group(group)
        tensor = tensor.contiguous()
        if input_splits is not None and output_splits is None:
            sizes = torch.tensor(input_splits, dtype=torch.int64, device=tensor.device)
            output_splits = self.all_to_all(sizes, group=group, tag=f"{tag} sizes").tolist()
        rows = sum(output_splits) if output_splits is not None else tensor.shape[0]
        out = tensor.new_empty((rows,) + tuple(tensor.shape[1:]))
        return self._run("all_to_all", tensor, out, group, async_op, None, tag,
                         lambda: dist.all_to_all_single(out, tensor, output_splits,
                                                        input_splits, group=group.pg,
                                                        async_op=async_op))

    def barrier(self, group=None, tag=""):
        group = self.ctx.group(group)
        return self._run("barrier", torch.empty(0), None, group, False, None, tag,
                         lambda: dist.barrier(group=group.pg))

    # --- point to point ------------------------------------------------------------------
    def send(self, tensor, dst, group=None, async_op=False, tag=""):
        """Send `tensor` to member `dst` of the group (the world: a global rank).

        The sender's virtual time travels with the message (an 8-byte stamp sent first).
        """
        peer = self.ctx.group(group).global_rank(dst)
        timing = self.ctx.clock.start_send(peer, tensor.nbytes)
        issued = timing.issued if timing is not None else 0.0  # None: the clock is off
        stamp = torch.tensor([issued], dtype=torch.float64, device=self.ctx.device)
        record = self._record("send", tensor, (self.ctx.rank, peer), tag, peer)
        t0 = time.perf_counter()
        self.ctx.set_status(f"send to rank {peer} ({tensor.nbytes} bytes) {tag}")
        if async_op:
            works = [dist.isend(stamp, peer), dist.isend(tensor.contiguous(), peer)]
            return Handle(self, _Works(works), tensor, record, t0, timing=timing)
        dist.send(stamp, peer)
        dist.send(tensor.contiguous(), peer)
        self.ctx.set_status("")
        self._finished(record, time.perf_counter() - t0, self.ctx.clock.finish_async(timing))
        return tensor

    def recv(self, tensor, src, group=None, async_op=False, tag=""):
        """Receive into `tensor` from member `src` of the group; waits (virtually) for it."""
        peer = self.ctx.group(group).global_rank(src)
        stamp = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        record = self._record("recv", tensor, (peer, self.ctx.rank), tag, peer)
        t0 = time.perf_counter()
        self.ctx.set_status(f"recv from rank {peer} ({tensor.nbytes} bytes) {tag}")
        if async_op:
            works = [dist.irecv(stamp, peer), dist.irecv(tensor, peer)]
            timing = self.ctx.clock.start_recv(peer, tensor.nbytes, stamp)
            return Handle(self, _Works(works), tensor, record, t0, timing=timing)
        dist.recv(stamp, peer)
        dist.recv(tensor, peer)
        self.ctx.set_status("")
        self._finished(record, time.perf_counter() - t0, self.ctx.clock.finish_async(
            self.ctx.clock.start_recv(peer, tensor.nbytes, stamp)))
        return tensor

    # --- the log ---------------------------------------------------------------------------
    def dataframe(self):
        """The last single calls, one row each (pandas DataFrame)."""
        import pandas as pd
        return pd.DataFrame([r.__dict__ for r in self.records])

    def summary(self, by=("op", "group")):
        """Totals per op and group (or `by` any of op, group, tag): calls, payload bytes
        (measured), ring-model wire bytes per rank (modelled), wall and modelled seconds."""
        rows = {}
        for (op, group, tag), total in self.totals.items():
            key = tuple(dict(op=op, group=group, tag=tag)[k] for k in by)
            row = rows.setdefault(key, dict(dict(zip(by, key)), calls=0, bytes=0,
                                            wire_bytes_per_rank=0.0, wall_s=0.0,
                                            modelled_s=0.0))
            for k in ("calls", "bytes", "wire_bytes_per_rank", "wall_s", "modelled_s"):
                row[k] += total[k]
        return list(rows.values())

    def wire_bytes(self, op=None):
        """Ring-model bytes this rank sent, for one op or all of them (modelled)."""
        return sum(t["wire_bytes_per_rank"] for (o, _, _), t in self.totals.items()
                   if op in (None, o))

    def reset(self):
        self.records.clear()
        self.totals.clear()

    # --- one place that runs and logs a collective -------------------------------------------
    def _record(self, op, tensor, ranks, tag="", peer=-1):
        record = CommRecord(op, len(ranks), str(tensor.dtype).replace("torch.", ""),
                            tensor.nbytes,
                            theory_time.wire_bytes_per_rank(op, tensor.nbytes, len(ranks)),
                            0.0, 0.0, False, tag, peer, _group_name(ranks))
        if self.recording:
            self.records.append(record)
            self._add(record, calls=1)
        return record

    def _add(self, record, calls=0, wall_s=0.0, modelled_s=0.0):
        total = self.totals.get((record.op, record.group, record.tag))
        if total is None:
            total = self.totals[(record.op, record.group, record.tag)] = dict(
                calls=0, bytes=0, wire_bytes_per_rank=0.0, wall_s=0.0, modelled_s=0.0)
        if calls:
            total["calls"] += calls
            total["bytes"] += record.bytes
            total["wire_bytes_per_rank"] += record.wire_bytes_per_rank
        total["wall_s"] += wall_s
        total["modelled_s"] += modelled_s

    def _finished(self, record, wall_s, modelled_s):
        record.wall_s, record.modelled_s = wall_s, modelled_s
        if self.recording:
            self._add(record, wall_s=wall_s, modelled_s=modelled_s)

    def _run(self, op, tensor, result, group, async_op, finish, tag, call):
        record = self._record(op, tensor, group.ranks, tag)
        record.async_op = async_op
        timing = self.ctx.clock.start_collective(op, tensor.nbytes, group, async_op)
        self.ctx.set_status(f"{op} (group {list(group.ranks)}, {tensor.nbytes} bytes) {tag}")
        t0 = time.perf_counter()
        work = call()
        handle = Handle(self, work, result, record, t0, finish=finish, timing=timing)
        if async_op:
            return handle
        handle.work = None  # the sync call already finished
        return handle.wait()


def _group_name(ranks):
    """A short name for a set of ranks: "0-3", "1,3"."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


@dataclass
class _Works:
    """Several works waited as one (a p2p message is its time stamp plus its tensor)."""
    works: list

    def wait(self):
        for w in self.works:
            w.wait()
