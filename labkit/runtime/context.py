"""What `fn(ctx)` receives on every rank: who it is, its groups, and its three instruments.

`ctx.comm` (the logged collectives), `ctx.memory` (bytes by category, peak) and `ctx.clock`
(the virtual timeline on a modelled cluster) are created here, once per rank, and passed
explicitly to every technique: there is no global process-group manager.
"""
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .clock import Clock
from .comm import Comm
from .memory import MemoryTracker

STATUS_WIDTH = 160  # bytes per rank in the shared status board the parent reads on a timeout


@dataclass(frozen=True)
class Group:
    """A set of global ranks that talk together, and this rank's place in it."""
    ranks: tuple
    pg: object  # a torch ProcessGroup, None for the default (world) group
    rank: int   # this process's index inside `ranks`

    @property
    def size(self):
        return len(self.ranks)


class Context:
    def __init__(self, rank, world_size, backend, cluster="8xH100-NVLink", status=None,
                 progress=None, seed=0):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")
        self.seed = seed
        self.world = Group(tuple(range(world_size)), None, rank)
        self._status, self._progress = status, progress
        self.started = time.perf_counter()
        self.clock = Clock(self, cluster)
        self.comm = Comm(self)
        self.memory = MemoryTracker(self)
        torch.manual_seed(seed)  # same seed everywhere: every replica starts identical

    def new_group(self, ranks):
        """One group from `ranks`. Every rank of the world must call this, in the same order."""
        ranks = tuple(sorted(ranks))
        pg = dist.new_group(list(ranks))
        return Group(ranks, pg, ranks.index(self.rank)) if self.rank in ranks else None

    def split_groups(self, partition):
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

    def set_status(self, text):
        """Tell the parent what this rank is waiting in (shown if the run times out)."""
        if self._status is None:
            return
        raw = text.encode()[:STATUS_WIDTH - 1] + b"\0"
        start = self.rank * STATUS_WIDTH
        self._status[start:start + len(raw)] = raw

    def progress(self, done, total):
        """Report steps done (rank 0's numbers drive the progress bar the caller sees)."""
        if self._progress is not None and self.rank == 0:
            self._progress[1], self._progress[0] = total, done

    def elapsed(self):
        """Wall-clock seconds since this rank's context was made."""
        return time.perf_counter() - self.started

    def __repr__(self):
        return (f"Context(rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend!r}, cluster={self.clock.cluster.name!r})")
