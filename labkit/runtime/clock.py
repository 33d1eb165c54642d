"""A virtual timeline per rank: what this run would take on a modelled cluster (e.g. 8xH100).

The clock logs what its rank does (`Clock.log`): compute spans with their counted FLOPs (as
PyTorch's FlopCounterMode counts them, see flops.py), each collective's issue and wait points,
each message sent and received, the step marks. It replays that log as it goes through
theory/'s pricing: compute takes FLOPs / the planner's in-step GEMM rate (peak x the GPU's
measured MAMF ceiling x the fitted in-step fraction, theory/step_rate.in_step_gemm_rate; not
the cluster's constant-MFU `mfu`). Each op's own shape is not priced: a miniature's tiny
matmuls would be launch-bound on an H100, so the clock times the FLOPs as if the modelled
model's large GEMMs ran them. A collective starts on the modelled cluster when its last member
issues it and lasts `theory.time.collective_time`; a message arrives at its sender's time plus
its transfer time. Async collectives run on a second lane (the comm stream), in issue order, so
communication hidden under compute shows as overlap: each collective's event records
`exposed_s` (the part the compute lane waited for it) and `hidden_s` (the part that ran under
compute). All times are *modelled*.

What a rank needs from the others is only when each member issued an op. Each rank posts its
issue times on a board: the launch's key-value store, beside the ops and never inside them (a
collective sends its own bytes and nothing else); a rank reads its peers' posts when it waits
for the op, once the op's data is there (so the posts are too). `replay(logs)` replays the
logs of every rank with no run at all (a hand-written log, or each rank's `ctx.clock.log`) and
places every event where the run's clock placed it.
"""
import itertools
from dataclasses import dataclass, field

from ..theory import hardware
from ..theory import time as theory_time
from ..theory.step_rate import in_step_gemm_rate
from .clock_board import DictBoard, NotPosted, StoreBoard, run_store
from .flops import start_counting, stop_counting


@dataclass
class Event:
    rank: int
    lane: str      # "compute" or "comm"
    kind: str      # "compute", "comm", "idle", "send", "recv"
    name: str
    start: float   # modelled seconds
    end: float
    wall_start: float = 0.0  # measured seconds since the rank started, for the wall timeline
    wall_end: float = 0.0
    meta: dict = field(default_factory=dict)


@dataclass
class _Timing:
    """The clock's note about one communication op, from issue to finish."""
    op: str
    nbytes: int
    duration: float
    issued: float                 # this rank's modelled time when it issued the op
    key: str = ""                 # the op's name on the board, the same on every member
    group_ranks: tuple = ()
    async_op: bool = False
    peer: int = -1
    wall_issued: float = 0.0
    number: int = 0               # its place among this rank's ops (the log's wait entries)
    group_ready: float = None     # collectives: the last member's issue time; recv: the send's
    complete: object = None       # comm's function that waits for the op's data
    resolved: bool = False
    end: float = 0.0


_live_boards = itertools.count(1)   # each rank makes its clocks in the same order: same numbers


class Clock:
    def __init__(self, ctx, cluster="8xH100-NVLink", compute_dtype="bf16", board=None):
        self.ctx = ctx
        self.cluster = hardware.cluster(cluster)
        if ctx.world_size > self.cluster.world_size:
            raise ValueError(f"cluster {self.cluster.name!r} has {self.cluster.world_size} GPUs, "
                             f"fewer than world_size={ctx.world_size}")
        self.compute_dtype = compute_dtype  # modelled as bf16 tensor-core math by default
        self.enabled = True
        self.t = 0.0          # this rank's compute lane, modelled seconds
        self.comm_free = 0.0  # when this rank's comm lane is next free
        self.events = []
        self.flops = 0
        self.step_marks = [0.0]
        self.log = []         # what this rank did, as `replay` reads it (see `_apply`)
        self._board = board   # None: the run's store, opened at the first op with peers
        self._board_number = next(_live_boards) if board is None else 0
        self._region = None
        self._pending = []    # async collectives issued and not yet placed on the comm lane
        self._open = {}       # op number -> its timing, from issue to finish
        self._ops = 0
        self._sequence = {}   # group ranks or (src, dst) -> ops so far: their board keys
        self._durations = {}  # (op, bytes, ranks) -> modelled seconds (the same op recurs)

    # --- compute ---------------------------------------------------------------------------
    @property
    def flops_per_s(self) -> float:
        """The FLOP/s a compute span runs at: the in-step GEMM rate (module docstring)."""
        return in_step_gemm_rate(self.cluster.gpu, self.compute_dtype)

    def compute(self, name: str = "compute", **meta: object) -> "_ComputeRegion":
        """Context manager: count the FLOPs run inside and advance the clock by their time."""
        return _ComputeRegion(self, name, meta)

    def add_compute(self, name: str, flops: float, **meta: object) -> None:
        """Advance by `flops` counted elsewhere (e.g. a formula), as a compute bar."""
        self._cut()
        wall = self.ctx.elapsed()
        self._log(("span", "compute", name, flops / self.flops_per_s, flops, meta, wall, wall))

    def advance(self, seconds: float, kind: str = "compute", name: str = "",
                **meta: object) -> None:
        """Advance by a modelled duration (e.g. a PCIe copy for CPU offload)."""
        self._cut()
        wall = self.ctx.elapsed()
        self._log(("span", kind, name, seconds, 0, meta, wall, wall))

    def now(self) -> float:
        """This rank's modelled time, including the FLOPs of a compute region still open."""
        if self._region is None:
            return self.t
        flops = self._region.counter.flops - self._region.flops_at_cut
        return self.t + flops / self.flops_per_s

    def mark_step(self) -> None:
        """Call after each training step: modelled step times come from these marks."""
        self._cut()
        self._log(("step",))

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.step_marks, self.step_marks[1:])]

    # --- communication (called by comm.py) ----------------------------------------------------
    def start_collective(self, op, nbytes, group, async_op=False):
        """Issue: the op's timing, this rank's issue time posted for its peers."""
        if not self.enabled:
            return None
        self._cut()
        return self._log(("issue", op, nbytes, tuple(group.ranks), async_op,
                          self.ctx.elapsed()))

    def start_send(self, dst, nbytes):
        if not self.enabled:
            return None
        self._cut()
        return self._log(("send", dst, nbytes, self.ctx.elapsed()))

    def start_recv(self, src, nbytes):
        """A message from `src`: it arrives at the send's time (read when waited) + transfer."""
        if not self.enabled:
            return None
        return self._log(("recv", src, nbytes, self.ctx.elapsed()))

    def finish_async(self, timing):
        """The op is done: place it on the timeline; return its modelled seconds."""
        if timing is None or not self.enabled:
            return 0.0
        if timing.op != "send":   # the sender does not wait for the message to land
            self._cut()
        return self._log(("wait", timing.number, self.ctx.elapsed()))

    # --- the log, replayed ---------------------------------------------------------------------
    def _log(self, entry):
        result = self._apply(entry)
        self.log.append(entry)
        return result

    def _apply(self, entry):
        """Advance the timeline by one log entry. Entries (plain tuples, wall: measured seconds):
        ("span", kind, name, seconds, flops, meta, wall_start, wall_end): compute, or a copy;
        ("issue", op, bytes, group ranks, async, wall); ("send", dst, bytes, wall);
        ("recv", src, bytes, wall); ("wait", op number (issue order), wall); ("step",).
        Raises NotPosted, with nothing changed, when a peer's issue time is not posted yet."""
        what = entry[0]
        if what == "span":
            _, kind, name, seconds, flops, meta, wall_start, wall_end = entry
            self._emit("compute", kind, name, self.t, self.t + seconds, wall_start, wall_end,
                       meta)
            self.t += seconds
            self.flops += flops
        elif what == "step":
            self.step_marks.append(self.t)
        elif what == "wait":
            return self._finish(self._open[entry[1]], entry[2])
        else:
            return self._issue(entry)

    def _issue(self, entry):
        rank = self.ctx.rank
        if entry[0] == "issue":
            _, op, nbytes, ranks, async_op, wall = entry
            timing = _Timing(op, nbytes, self._duration(op, nbytes, ranks), self.t,
                             self._key("c", ranks), ranks, async_op, wall_issued=wall)
            if len(ranks) == 1:
                timing.group_ready = self.t
            else:
                self.board.post(timing.key, rank, self.t)
            if async_op:
                self._pending.append(timing)
        elif entry[0] == "send":
            _, dst, nbytes, wall = entry
            timing = _Timing("send", nbytes, self._duration("send", nbytes, (rank, dst)),
                             self.t, self._key("p", (rank, dst)), peer=dst, wall_issued=wall)
            self.board.post(timing.key, rank, self.t)
        else:
            _, src, nbytes, wall = entry
            timing = _Timing("recv", nbytes, self._duration("send", nbytes, (rank, src)),
                             self.t, self._key("p", (src, rank)), peer=src, wall_issued=wall)
        timing.number, self._ops = self._ops, self._ops + 1
        self._open[timing.number] = timing
        return timing

    def _key(self, kind, ranks):
        number = self._sequence.get((kind, ranks), 0)
        self._sequence[(kind, ranks)] = number + 1
        return f"{kind}{','.join(map(str, ranks))}#{number}"

    @property
    def board(self):
        if self._board is None:
            self._board = StoreBoard(run_store(), f"labkit-clock/{self._board_number}/")
        return self._board

    def _ready(self, timing):
        """Fill `timing.group_ready` from the peers' posts (after waiting for the op's data)."""
        if timing.group_ready is not None:
            return
        if timing.complete is not None:
            complete, timing.complete = timing.complete, None
            complete()
        if timing.op == "recv":
            timing.group_ready = self.board.read(timing.key, (timing.peer,))[0]
        else:
            others = tuple(r for r in timing.group_ranks if r != self.ctx.rank)
            timing.group_ready = max(timing.issued, *self.board.read(timing.key, others))

    def _finish(self, timing, wall_now):
        if timing.op == "send":
            del self._open[timing.number]
            self._emit("comm", "send", f"send to {timing.peer}", timing.issued,
                       timing.issued + timing.duration, timing.wall_issued, wall_now)
            return timing.duration
        if timing.op == "recv":
            self._ready(timing)
            del self._open[timing.number]
            sent = timing.group_ready
            arrival = sent + timing.duration
            exposed = min(timing.duration, max(0.0, arrival - self.t))  # what compute waits
            self._emit("comm", "recv", f"recv from {timing.peer}", sent, arrival,
                       timing.wall_issued, wall_now, dict(
                           bytes=timing.nbytes, exposed_s=exposed,
                           hidden_s=timing.duration - exposed))
            self._advance_to(arrival, f"wait for rank {timing.peer}", wall_now)
            return timing.duration
        # A collective: earlier async ones take the comm lane first, in issue order.
        if timing.resolved:      # placed while waiting for a later op: only wait for its end;
            del self._open[timing.number]   # ops issued after it stay pending (placing
            self._advance_to(timing.end, f"wait for {timing.op}", wall_now)  # them now would
            return timing.duration                                    # call them exposed)
        placed = []
        if self._pending and self._pending[0] is not timing:
            placed = list(itertools.takewhile(lambda e: e is not timing, self._pending))
        placed.append(timing)
        for each in placed:      # every post first: a replay may have to come back later
            self._ready(each)
        del self._open[timing.number]
        waited_from = self.t     # compute stops here until the op is done: what is after, shows
        for each in placed:
            end = self._place(each, wall_now, waited_from)
        self._advance_to(end, f"wait for {timing.op}", wall_now)
        return timing.duration

    def _duration(self, op, nbytes, ranks):
        key = (op, nbytes, ranks)
        duration = self._durations.get(key)
        if duration is None:
            duration = self._durations[key] = theory_time.collective_time(
                op, nbytes, len(ranks), self.cluster.link_for(ranks))
        return duration

    def _place(self, timing, wall_now, waited_from):
        start = max(timing.group_ready, self.comm_free)
        timing.end = start + timing.duration
        self.comm_free = timing.end
        lane, kind = ("comm", "comm") if timing.async_op else ("compute", "comm")
        if timing.async_op:   # the part after compute stopped to wait is exposed
            exposed = min(timing.duration, max(0.0, timing.end - max(start, waited_from)))
        else:
            exposed = timing.duration
            self._advance_to(start, f"wait for {timing.op}", wall_now)
        self._emit(lane, kind, timing.op, start, timing.end, timing.wall_issued, wall_now,
                   dict(bytes=timing.nbytes, group=list(timing.group_ranks),
                        exposed_s=exposed, hidden_s=timing.duration - exposed))
        if not timing.async_op:
            self.t = max(self.t, timing.end)
        timing.resolved = True
        if timing.async_op:
            self._pending.remove(timing)
        return timing.end

    # --- the timeline --------------------------------------------------------------------------
    def timeline(self) -> list[dict]:
        """Every event of this rank as a dict (modelled start/end, wall start/end)."""
        return [e.__dict__.copy() for e in self.events]

    def _advance_to(self, target, why, wall):
        if target > self.t:
            self._emit("compute", "idle", why, self.t, target, wall, wall)
            self.t = target

    def _cut(self):
        """Log the compute of an open region up to now (so waits land in between)."""
        region = self._region
        if region is None:
            return
        flops = region.counter.flops
        counted = flops - region.flops_at_cut
        wall = self.ctx.elapsed()
        if counted > 0:
            self._log(("span", "compute", region.name, counted / self.flops_per_s, counted,
                       dict(region.meta, flops=counted), region.wall_start, wall))
        region.flops_at_cut = flops
        region.wall_start = wall

    def _emit(self, lane, kind, name, start, end, wall_start, wall_end, meta=None):
        self.events.append(Event(self.ctx.rank, lane, kind, name, start, end, wall_start,
                                 wall_end, meta or {}))


@dataclass
class _Rank:
    """What a replayed clock needs of a context: who it is."""
    rank: int
    world_size: int

    def elapsed(self):
        return 0.0


def replay(logs, cluster="8xH100-NVLink", compute_dtype="bf16"):
    """The clocks of a run from every rank's log ({rank: entries}, as `Clock.log` keeps them):
    each rank replays until it waits for a peer that has not issued the op yet, then the next
    takes its turn. Raises ValueError when no rank can go on (the logs cannot have run)."""
    board, world = DictBoard(), max(logs) + 1
    clocks = {r: Clock(_Rank(r, world), cluster, compute_dtype, board) for r in logs}
    done = {r: 0 for r in logs}
    while any(done[r] < len(logs[r]) for r in logs):
        moved = False
        for rank, entries in logs.items():
            clock = clocks[rank]
            try:
                while done[rank] < len(entries):
                    clock._log(entries[done[rank]])
                    done[rank] += 1
                    moved = True
            except NotPosted:
                continue
        if not moved:
            stuck = {r: logs[r][done[r]] for r in logs if done[r] < len(logs[r])}
            raise ValueError(f"the logs cannot have run: every rank waits for a peer ({stuck})")
    return clocks


class _Region:
    __slots__ = ("name", "meta", "counter", "flops_at_cut", "wall_start")

    def __init__(self, name, meta, counter, wall_start):
        self.name, self.meta, self.counter = name, meta, counter
        self.flops_at_cut = 0
        self.wall_start = wall_start


class _ComputeRegion:
    __slots__ = ("clock", "name", "meta", "outer")

    def __init__(self, clock, name, meta):
        self.clock, self.name, self.meta = clock, name, meta
        self.outer = False

    def __enter__(self):
        clock = self.clock
        if clock._region is not None or not clock.enabled:  # nested: the outer region counts
            self.outer = True
            return self
        clock._cut()
        clock._region = _Region(self.name, self.meta, start_counting(), clock.ctx.elapsed())
        return self

    def __exit__(self, *exc):
        if self.outer:
            return False
        clock = self.clock
        clock._cut()
        region, clock._region = clock._region, None
        stop_counting(region.counter, exc)
        return False
