"""What `fn(ctx)` receives on every rank: who it is, its groups, and its three instruments.

`ctx.comm` (the logged collectives), `ctx.memory` (bytes by category, peak) and `ctx.clock`
(the virtual timeline on a modelled cluster) are created here, once per rank. Techniques take
their process group explicitly (`group=None` means the world); `context()` finds the process's
context, so a building block works under `launch`, under `torchrun` and in a learner's own
`mp.spawn` program that called `torch.distributed.init_process_group` itself.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch
import torch.distributed as dist

from .clock import Clock
from .comm import Comm
from .comm_log import group_name
from .memory import MemoryTracker
from .mesh import Mesh

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

STATUS_WIDTH = 160  # bytes per rank in the shared status board the parent reads on a timeout

_current = None     # this process's Context (one per rank process)


@dataclass(frozen=True)
class Group:
    """A set of global ranks that talk together, and this rank's place in it."""
    ranks: tuple[int, ...]
    pg: ProcessGroup | None  # None for the default (world) group
    rank: int   # this process's index inside `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, group_rank: int) -> int:
        """The world rank of the group's member number `group_rank`."""
        return self.ranks[group_rank]

    @property
    def name(self):
        """The group's short name in the comm log ("0-3", "1,3")."""
        return group_name(self.ranks)


def context() -> Context:
    """This process's Context: the `ctx` of `launch`, or one made now from the default group.

    A program that initialised torch.distributed itself (mp.spawn, torchrun) gets a context on
    first use, on a modelled cluster large enough for its world; the RNG state is not touched.
    """
    global _current
    if _current is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group(...) first, or run the "
                               "function with labkit.launch(fn, world_size)")
        world = dist.get_world_size()
        cluster = "8xH100-NVLink" if world <= 8 else f"{-(-world // 8)}x8xH100-IB"
        Context(dist.get_rank(), world, dist.get_backend(), cluster=cluster)
    return _current


Mesh.find_context = staticmethod(context)   # Mesh(dp=..) without ctx= uses this process's

# what every `group=` takes: None (the world), a labkit Group, or a torch ProcessGroup
GroupLike = Union[Group, "ProcessGroup", None]


class Context:
    def __init__(self, rank: int, world_size: int, backend: str, cluster: str = "8xH100-NVLink",
                 status=None, progress=None, seed: int = 0) -> None:
        global _current
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")
        self.seed = seed
        self.world = Group(tuple(range(world_size)), None, rank)
        self._status, self._progress = status, progress
        self._groups = {}      # torch ProcessGroup -> Group, for groups a user made
        self.collectives = 0   # collectives this rank has entered (a mismatch names counts)
        self._last_op = ""     # the last one it was in (a rank gloo aborts may have left it)
        self.started = time.perf_counter()
        self.reset_instruments(cluster)
        _current = self

    def reset_instruments(self, cluster=None):
        """A fresh clock (on `cluster`, default the current one), comm log and memory tracker:
        several measured runs in one launch (a sweep: starting ranks is the slow part) each
        get their own. Blocks find them through the context, so none holds an old one."""
        self.clock = Clock(self, cluster or self.clock.cluster)
        self.comm = Comm(self)
        self.memory = MemoryTracker(self)

    # --- groups ---------------------------------------------------------------------------
    def group(self, group: GroupLike = None) -> Group:
        """A labkit Group for `group`: None (the world), a Group, or a torch ProcessGroup."""
        if group is None:
            return self.world
        if isinstance(group, Group):
            return group
        known = self._groups.get(group)
        if known is None:
            ranks = tuple(dist.get_process_group_ranks(group))
            if self.rank not in ranks:
                raise ValueError(f"rank {self.rank} is not in the process group {list(ranks)}")
            known = self._groups[group] = Group(ranks, group, ranks.index(self.rank))
        return known

    def new_group(self, ranks: Iterable[int]) -> Group | None:
        """One group from `ranks`. Every rank of the world must call this, in the same order."""
        ranks = tuple(sorted(ranks))
        pg = dist.new_group(list(ranks))
        return Group(ranks, pg, ranks.index(self.rank)) if self.rank in ranks else None

    def split_groups(self, partition: Sequence[Sequence[int]]) -> Group:
        """Groups for a partition of the world (e.g. every DP or TP group of a mesh).

        Every rank calls it with the same list of rank lists; it gets back its own group.
        """
        mine = None
        for ranks in partition:
            group = self.new_group(ranks)
            if group is not None:
                mine = group
        if mine is None:
            raise ValueError(f"rank {self.rank} is in none of the groups {partition}")
        return mine

    def mesh(self, **sizes: int) -> Mesh:
        """A Mesh of named sub-groups, e.g. `ctx.mesh(dp=2, tp=2, pp=2)` (TP innermost)."""
        return Mesh(ctx=self, **sizes)

    # --- bookkeeping a training loop needs -------------------------------------------------
    @contextmanager
    def step(self, index: int, total: int | None = None) -> Iterator[None]:
        """`with ctx.step(i, steps):` one training step: memory sample, clock mark, progress."""
        yield
        self.memory.sample(f"after step {index}")
        self.clock.mark_step()
        if total is not None:
            self.progress(index + 1, total)

    @contextmanager
    def off_the_record(self) -> Iterator[None]:
        """Run something (a warm-up, a check) without logging its comm or advancing the clock."""
        was = self.comm.recording, self.clock.enabled
        self.comm.recording, self.clock.enabled = False, False
        try:
            yield
        finally:
            self.comm.recording, self.clock.enabled = was

    def set_status(self, text):
        """Tell the parent what this rank is waiting in (shown if the run times out or a rank
        dies), after how many collectives and the last it was in: "count|text|last"."""
        if self._status is None:
            return
        self._last_op = text or self._last_op
        raw = f"{self.collectives}|{text}|{self._last_op}".encode()[:STATUS_WIDTH - 1] + b"\0"
        start = self.rank * STATUS_WIDTH
        self._status[start:start + len(raw)] = raw

    def progress(self, done: int, total: int) -> None:
        """Report steps done (rank 0's numbers drive the progress bar the caller sees)."""
        if self._progress is not None and self.rank == 0:
            self._progress[1], self._progress[0] = total, done

    def elapsed(self) -> float:
        """Wall-clock seconds since this rank's context was made."""
        return time.perf_counter() - self.started

    def __repr__(self):
        return (f"Context(rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend!r}, cluster={self.clock.cluster.name!r})")
