"""A virtual timeline per rank: what this run would take on a modelled cluster (e.g. 8xH100).

Compute advances a rank's time by counted FLOPs / (peak FLOP/s x MFU) (FLOPs from PyTorch's
FlopCounterMode); a collective starts when the last member reaches it and lasts its alpha-beta
time; a message arrives at the sender's time plus its transfer time. Async collectives run on a
second lane, so communication hidden under compute shows as overlap. All times are *modelled*.
"""
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from ..theory import hardware
from ..theory import time as theory_time


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
    issued: float
    group_ranks: tuple = ()
    stamp: torch.Tensor = None
    work: object = None
    async_op: bool = False
    peer: int = -1
    wall_issued: float = 0.0
    resolved: bool = False


class _Region:
    def __init__(self, name, meta, mode, wall_start):
        self.name, self.meta, self.mode = name, meta, mode
        self.flops_at_cut = 0
        self.wall_start = wall_start


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

    # --- compute ---------------------------------------------------------------------------
    @property
    def flops_per_s(self):
        return self.cluster.gpu.flops(self.compute_dtype) * self.cluster.mfu

    def compute(self, name="compute", **meta):
        """Context manager: count the FLOPs run inside and advance the clock by their time."""
        return _ComputeRegion(self, name, meta)

    def add_compute(self, name, flops, **meta):
        """Advance by `flops` counted elsewhere (e.g. a formula), as a compute bar."""
        self._cut()
        dt = flops / self.flops_per_s
        self._emit("compute", "compute", name, self.t, self.t + dt, meta=meta)
        self.t += dt
        self.flops += flops

    def advance(self, seconds, kind="compute", name="", **meta):
        """Advance by a modelled duration (e.g. a PCIe copy for CPU offload)."""
        self._cut()
        self._emit("compute", kind, name, self.t, self.t + seconds, meta=meta)
        self.t += seconds

    def now(self):
        """This rank's modelled time, including the FLOPs of a compute region still open."""
        if self._region is None:
            return self.t
        flops = self._region.mode.get_total_flops() - self._region.flops_at_cut
        return self.t + flops / self.flops_per_s

    def mark_step(self):
        """Call after each training step: modelled step times come from these marks."""
        self._cut()
        self.step_marks.append(self.t)

    def step_times(self):
        return [b - a for a, b in zip(self.step_marks, self.step_marks[1:])]

    # --- communication -----------------------------------------------------------------------
    def start_collective(self, op, nbytes, group, async_op=False):
        """Issue: share this rank's time with the group so the op starts when the last arrives."""
        if not self.enabled:
            return None
        self._cut()
        duration = theory_time.collective_time(op, nbytes, group.size,
                                               self.cluster.link_for(group.ranks))
        stamp = torch.tensor([self.now()], dtype=torch.float64, device=self.ctx.device)
        work = None
        if group.size > 1:
            work = dist.all_reduce(stamp, dist.ReduceOp.MAX, group=group.pg, async_op=True)
        timing = _Timing(op, nbytes, duration, self.now(), group.ranks, stamp, work, async_op,
                         wall_issued=self.ctx.elapsed())
        if async_op:
            self._pending.append(timing)
        return timing

    def start_send(self, dst, nbytes):
        if not self.enabled:
            return None
        self._cut()
        link = self.cluster.link_for((self.ctx.rank, dst))
        return _Timing("send", nbytes, theory_time.collective_time("send", nbytes, 2, link),
                       self.now(), peer=dst, wall_issued=self.ctx.elapsed())

    def start_recv(self, src, nbytes, stamp):
        if not self.enabled:
            return None
        link = self.cluster.link_for((self.ctx.rank, src))
        return _Timing("recv", nbytes, theory_time.collective_time("send", nbytes, 2, link),
                       self.now(), stamp=stamp, peer=src, wall_issued=self.ctx.elapsed())

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
            sent = float(timing.stamp.item())
            arrival = sent + timing.duration
            self._emit("comm", "recv", f"recv from {timing.peer}", sent, arrival,
                       timing.wall_issued, wall_now)
            self._advance_to(arrival, f"wait for rank {timing.peer}")
            return timing.duration
        # A collective: earlier async ones take the comm lane first, in issue order.
        for earlier in list(self._pending):
            if earlier is timing:
                break
            self._place(earlier, wall_now)
        end = self._place(timing, wall_now)
        self._advance_to(end, f"wait for {timing.op}")
        return timing.duration

    def _place(self, timing, wall_now):
        if timing.resolved:
            return timing.end
        if timing.work is not None:
            timing.work.wait()
        group_ready = float(timing.stamp.item())
        start = max(group_ready, self.comm_free)
        timing.end = start + timing.duration
        self.comm_free = timing.end
        lane, kind = ("comm", "comm") if timing.async_op else ("compute", "comm")
        if not timing.async_op:
            self._advance_to(start, f"wait for {timing.op}")
        self._emit(lane, kind, timing.op, start, timing.end, timing.wall_issued, wall_now,
                   meta=dict(bytes=timing.nbytes, group=list(timing.group_ranks)))
        if not timing.async_op:
            self.t = max(self.t, timing.end)
        timing.resolved = True
        if timing in self._pending:
            self._pending.remove(timing)
        return timing.end

    # --- the timeline --------------------------------------------------------------------------
    def timeline(self):
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
        flops = region.mode.get_total_flops()
        dt = (flops - region.flops_at_cut) / self.flops_per_s
        wall = self.ctx.elapsed()
        if dt > 0:
            self._emit("compute", "compute", region.name, self.t, self.t + dt,
                       region.wall_start, wall, meta=dict(region.meta, flops=flops -
                                                          region.flops_at_cut))
            self.t += dt
            self.flops += flops - region.flops_at_cut
        region.flops_at_cut = flops
        region.wall_start = wall

    def _emit(self, lane, kind, name, start, end, wall_start=None, wall_end=None, meta=None):
        now = self.ctx.elapsed()
        self.events.append(Event(self.ctx.rank, lane, kind, name, start, end,
                                 now if wall_start is None else wall_start,
                                 now if wall_end is None else wall_end, meta or {}))


class _ComputeRegion:
    def __init__(self, clock, name, meta):
        self.clock, self.name, self.meta = clock, name, meta
        self.outer = False

    def __enter__(self):
        clock = self.clock
        if clock._region is not None or not clock.enabled:  # nested: the outer region counts
            self.outer = True
            return self
        clock._cut()
        mode = FlopCounterMode(display=False)
        mode.__enter__()
        clock._region = _Region(self.name, self.meta, mode, clock.ctx.elapsed())
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.outer:
            return False
        clock = self.clock
        clock._cut()
        region, clock._region = clock._region, None
        region.mode.__exit__(*exc)
        return False
