"""A virtual timeline per rank: what this run would take on a modelled cluster (e.g. 8xH100).

Compute advances a rank's time by counted FLOPs / (peak FLOP/s x MFU) (counted as PyTorch's
FlopCounterMode counts them, see flops.py); a collective starts when the last member reaches it
and lasts its alpha-beta time; a message arrives at the sender's time plus its transfer time. Async
collectives run on a second lane (the comm stream), so communication hidden under compute shows as
overlap: each collective's event records `exposed_s` (the part the compute lane waited for it)
and `hidden_s` (the part that ran under compute). All times are *modelled*.

How the ranks learn each other's time: `ctx.comm` carries each rank's time stamp inside the
collective or message itself (a few extra elements of the same op, see comm.py), so the clock
adds no extra round of communication; the comm log shows those bytes as the clock's own
(tag "clock"). The clock only decides what the stamps mean.
"""
from dataclasses import dataclass, field

from ..theory import hardware
from ..theory import time as theory_time
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
    group_ranks: tuple = ()
    async_op: bool = False
    peer: int = -1
    wall_issued: float = 0.0
    group_ready: float = None     # collectives: the last member's issue time; recv: the send's
    complete: object = None       # comm's function that waits for the op and fills group_ready
    resolved: bool = False
    end: float = 0.0


class Clock:
    def __init__(self, ctx, cluster="8xH100-NVLink", compute_dtype="bf16"):
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
        self._region = None
        self._pending = []    # async collectives issued and not yet placed on the comm lane
        self._durations = {}  # (op, bytes, ranks) -> modelled seconds (the same op recurs)

    # --- compute ---------------------------------------------------------------------------
    @property
    def flops_per_s(self) -> float:
        return self.cluster.gpu.flops(self.compute_dtype) * self.cluster.mfu

    def compute(self, name: str = "compute", **meta: object) -> "_ComputeRegion":
        """Context manager: count the FLOPs run inside and advance the clock by their time."""
        return _ComputeRegion(self, name, meta)

    def add_compute(self, name: str, flops: float, **meta: object) -> None:
        """Advance by `flops` counted elsewhere (e.g. a formula), as a compute bar."""
        self._cut()
        dt = flops / self.flops_per_s
        self._emit("compute", "compute", name, self.t, self.t + dt, meta=meta)
        self.t += dt
        self.flops += flops

    def advance(self, seconds: float, kind: str = "compute", name: str = "",
                **meta: object) -> None:
        """Advance by a modelled duration (e.g. a PCIe copy for CPU offload)."""
        self._cut()
        self._emit("compute", kind, name, self.t, self.t + seconds, meta=meta)
        self.t += seconds

    def now(self) -> float:
        """This rank's modelled time, including the FLOPs of a compute region still open."""
        if self._region is None:
            return self.t
        flops = self._region.counter.flops - self._region.flops_at_cut
        return self.t + flops / self.flops_per_s

    def mark_step(self) -> None:
        """Call after each training step: modelled step times come from these marks."""
        self._cut()
        self.step_marks.append(self.t)

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.step_marks, self.step_marks[1:])]

    # --- communication (called by comm.py) ----------------------------------------------------
    def start_collective(self, op, nbytes, group, async_op=False):
        """Issue: note this rank's time; comm carries it to the group with the op's data."""
        if not self.enabled:
            return None
        self._cut()
        now = self.t
        timing = _Timing(op, nbytes, self._duration(op, nbytes, group.ranks), now, group.ranks,
                         async_op, wall_issued=self.ctx.elapsed())
        if group.size == 1:
            timing.group_ready = now
        if async_op:
            self._pending.append(timing)
        return timing

    def start_send(self, dst, nbytes):
        if not self.enabled:
            return None
        self._cut()
        return _Timing("send", nbytes, self._duration("send", nbytes, (self.ctx.rank, dst)),
                       self.t, peer=dst, wall_issued=self.ctx.elapsed())

    def start_recv(self, src, nbytes, sent=None):
        """A message from `src`; `sent` is the sender's time stamp (None: not arrived yet)."""
        if not self.enabled:
            return None
        return _Timing("recv", nbytes, self._duration("send", nbytes, (self.ctx.rank, src)),
                       self.now(), peer=src, wall_issued=self.ctx.elapsed(), group_ready=sent)

    def finish_async(self, timing):
        """The op's data is here: place it on the timeline; return its modelled seconds."""
        if timing is None or not self.enabled:
            return 0.0
        wall_now = self.ctx.elapsed()
        if timing.op == "send":  # the sender does not wait for the message to land
            self._emit("comm", "send", f"send to {timing.peer}", timing.issued,
                       timing.issued + timing.duration, timing.wall_issued, wall_now)
            return timing.duration
        if timing.op == "recv":
            self._cut()
            sent = timing.group_ready
            arrival = sent + timing.duration
            exposed = min(timing.duration, max(0.0, arrival - self.t))  # what compute waits
            self._emit("comm", "recv", f"recv from {timing.peer}", sent, arrival,
                       timing.wall_issued, wall_now, meta=dict(
                           bytes=timing.nbytes, exposed_s=exposed,
                           hidden_s=timing.duration - exposed))
            self._advance_to(arrival, f"wait for rank {timing.peer}")
            return timing.duration
        # A collective: earlier async ones take the comm lane first, in issue order.
        self._cut()
        if timing.resolved:      # placed while waiting for a later op: only wait for its end;
            self._advance_to(timing.end, f"wait for {timing.op}")   # ops issued after it stay
            return timing.duration      # pending (placing them now would call them exposed)
        waited_from = self.t     # compute stops here until the op is done: what is after, shows
        if self._pending and self._pending[0] is not timing:
            for earlier in list(self._pending):
                if earlier is timing:
                    break
                self._place(earlier, wall_now, waited_from)
        end = self._place(timing, wall_now, waited_from)
        self._advance_to(end, f"wait for {timing.op}")
        return timing.duration

    def _duration(self, op, nbytes, ranks):
        key = (op, nbytes, ranks)
        duration = self._durations.get(key)
        if duration is None:
            duration = self._durations[key] = theory_time.collective_time(
                op, nbytes, len(ranks), self.cluster.link_for(ranks))
        return duration

    def _place(self, timing, wall_now, waited_from):
        if timing.resolved:
            return timing.end
        if timing.group_ready is None:
            timing.complete()   # wait for the op: the members' stamps travel with its data
        start = max(timing.group_ready, self.comm_free)
        timing.end = start + timing.duration
        self.comm_free = timing.end
        lane, kind = ("comm", "comm") if timing.async_op else ("compute", "comm")
        if timing.async_op:   # the part after compute stopped to wait is exposed
            exposed = min(timing.duration, max(0.0, timing.end - max(start, waited_from)))
        else:
            exposed = timing.duration
            self._advance_to(start, f"wait for {timing.op}")
        self._emit(lane, kind, timing.op, start, timing.end, timing.wall_issued, wall_now,
                   meta=dict(bytes=timing.nbytes, group=list(timing.group_ranks),
                             exposed_s=exposed, hidden_s=timing.duration - exposed))
        if not timing.async_op:
            self.t = max(self.t, timing.end)
        timing.resolved = True
        timing.complete = None   # drop comm's buffers with it
        if timing.async_op:
            self._pending.remove(timing)
        return timing.end

    # --- the timeline --------------------------------------------------------------------------
    def timeline(self) -> list[dict]:
        """Every event of this rank as a dict (modelled start/end, wall start/end)."""
        return [e.__dict__.copy() for e in self.events]

    def _advance_to(self, target, why):
        self._cut()
        if target > self.t:
            self._emit("compute", "idle", why, self.t, target)
            self.t = target

    def _cut(self):
        """Close the compute bar of an open region up to now (so waits land in between)."""
        region = self._region
        if region is None:
            return
        flops = region.counter.flops
        counted = flops - region.flops_at_cut
        wall = self.ctx.elapsed()
        if counted > 0:
            dt = counted / self.flops_per_s
            self._emit("compute", "compute", region.name, self.t, self.t + dt,
                       region.wall_start, wall, meta=dict(region.meta, flops=counted))
            self.t += dt
            self.flops += counted
        region.flops_at_cut = flops
        region.wall_start = wall

    def _emit(self, lane, kind, name, start, end, wall_start=None, wall_end=None, meta=None):
        if wall_start is None or wall_end is None:
            now = self.ctx.elapsed()
            wall_start = now if wall_start is None else wall_start
            wall_end = now if wall_end is None else wall_end
        self.events.append(Event(self.ctx.rank, lane, kind, name, start, end, wall_start,
                                 wall_end, meta or {}))


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
