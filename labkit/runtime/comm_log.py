"""What the collectives record: one row per call, running totals, and the tables read from them.

Each record (`CommRecord`): op, group, tag, payload bytes (the tensor this rank handed in,
measured), the ring-model bytes this rank would send on the wire (all_reduce 2(n-1)/n S,
all_gather and reduce_scatter (n-1)/n of the full tensor: *modelled*, gloo does not report its
own), wall seconds (measured) and modelled seconds on the clock. The log keeps running totals
per (op, group, tag) and only the last `KEEP_RECORDS` single calls, so a long run does not grow
it.

`CommLog` is the bookkeeping half of `runtime.comm.Comm` (which runs the ops and extends it):
`summary`, `wire_bytes`, `dataframe`, `reset`, and `recording` (False inside
`ctx.off_the_record()`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..theory import time as theory_time

if TYPE_CHECKING:
    import pandas

_FIELDS = ("calls", "bytes", "wire_bytes_per_rank", "wall_s", "modelled_s")


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


KEEP_RECORDS = 10_000   # single calls kept for inspection; totals are kept for every call


class CommLog:
    """The records and totals of one rank's communication (see the module docstring)."""

    def __init__(self) -> None:
        self.records = deque(maxlen=KEEP_RECORDS)
        self.totals = {}        # (op, group, tag) -> calls, bytes, wire bytes, seconds
        self.recording = True   # False inside ctx.off_the_record()
        self._names = {}        # ranks -> group name, dtype -> name (asked on every call)

    def dataframe(self) -> pandas.DataFrame:
        """The last single calls, one row each (pandas DataFrame)."""
        import pandas as pd
        return pd.DataFrame([r.__dict__ for r in self.records])

    def summary(self, by: Sequence[str] = ("op", "group")) -> list[dict]:
        """Totals per op and group (or `by` any of op, group, tag): calls, payload bytes
        (measured), ring-model wire bytes per rank (modelled), wall and modelled seconds."""
        rows = {}
        for (op, group, tag), total in self.totals.items():
            values = dict(op=op, group=group, tag=tag)
            _accumulate(rows, tuple(values[k] for k in by), by, total)
        return list(rows.values())

    def wire_bytes(self, op: str | None = None) -> float:
        """Ring-model bytes this rank sent, for one op or all of them (modelled)."""
        return sum(t["wire_bytes_per_rank"] for (o, _, _), t in self.totals.items()
                   if op in (None, o))

    def reset(self) -> None:
        self.records.clear()
        self.totals.clear()

    # --- what one call adds ---------------------------------------------------------------
    def _record(self, op, tensor, ranks, tag="", peer=-1):
        names = self._names
        group, dtype = names.get(ranks), names.get(tensor.dtype)
        if group is None:
            group = names[ranks] = group_name(ranks)
        if dtype is None:
            dtype = names[tensor.dtype] = str(tensor.dtype).replace("torch.", "")
        nbytes = tensor.nbytes
        record = CommRecord(op, len(ranks), dtype, nbytes,
                            theory_time.wire_bytes_per_rank(op, nbytes, len(ranks)),
                            0.0, 0.0, False, tag, peer, group)
        if self.recording:
            self.records.append(record)
            total = _total(self.totals, (op, group, tag))
            total["calls"] += 1
            total["bytes"] += nbytes
            total["wire_bytes_per_rank"] += record.wire_bytes_per_rank
        return record

    def _finished(self, record, wall_s, modelled_s):
        record.wall_s, record.modelled_s = wall_s, modelled_s
        if self.recording:
            total = self.totals.get((record.op, record.group, record.tag))
            if total is not None:
                total["wall_s"] += wall_s
                total["modelled_s"] += modelled_s


def _accumulate(rows, key, by, total):
    row = rows.get(key)
    if row is None:
        row = rows[key] = dict(zip(by, key), **{k: 0 for k in _FIELDS})
    for k in _FIELDS:
        row[k] += total[k]


def _total(totals, key):
    total = totals.get(key)
    if total is None:
        total = totals[key] = dict(calls=0, bytes=0, wire_bytes_per_rank=0.0, wall_s=0.0,
                                   modelled_s=0.0)
    return total


def group_name(ranks: Iterable[int]) -> str:
    """A short name for a set of ranks: "0-3", "1,3"."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
