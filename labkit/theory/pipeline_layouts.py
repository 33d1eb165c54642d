"""Pipeline schedules on any stage layout: looped, V-shaped and bidirectional (DualPipe).

`labkit.theory.pipeline` places stage s on rank s % P (the looped layout). Newer schedules place
stages otherwise, and this module replays them with the same timing rules:
- "loop": stage c*P + r on rank r as its chunk c (Megatron-LM's interleaving; V = 1: plain);
- "v": a 2P-stage model, rank r holding stages r (chunk 0) and 2P-1-r (chunk 1), so a
  micro-batch goes down the ranks and back up (ZB-V, Qi et al. 2023, arXiv 2401.10241 sec. 6;
  torch's ScheduleZBVZeroBubble and ScheduleDualPipeV);
- "dual": DualPipe (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.2.1): a P-stage
  model held twice, rank r holding stage r (chunk 0) and stage P-1-r (chunk 1). Micro-batches
  0 .. M/2-1 enter at rank 0 and run through the chunks 0; M/2 .. M-1 enter at rank P-1 and
  run through the chunks 1. Both directions' work fills each other's bubbles; the weights of
  stage s live on ranks s and P-1-s (2x the parameters; their gradients are summed).

A schedule here is a `LaidOut`: per rank the ops (kind, micro-batch, chunk), kind "F", "B"
(input gradient) or "W" (weight gradient; a full backward is B then W), the layout, and per
rank its slots: ops run as one unit, whose outputs leave together at its end. A full
backward (B and W in one autograd call, its input gradient sent after both) is a slot B, W;
DualPipe's "F&B" overlaps the forward of one micro-batch with the full backward of another:
a slot F, B, W that starts when both inputs are there; with free links it takes
T_F + T_B + T_W, the overlap hiding communication only.

Idle per rank, the report's Table 2 (F, B full backward, W weight part, F&B one overlapped
slot; here B = T_B + T_W and, with free links, F&B = T_F + T_B + T_W):
1F1B (P-1)(F+B); ZB1P (ZB-H1) (P-1)(F+B-2W); DualPipe (P/2-1)(F&B+B-3W).
Parameters per rank 1x, 1x, 2x; activations P, P, P+1 (micro-batches x one stage).
Replayed here, DualPipe's order idles exactly the table's amount, the same on every rank, when
T_F = T_B; less when T_B > T_F, more when T_F > T_B (tests/test_pipeline_layouts.py).
No torch here.
"""
from __future__ import annotations

from typing import NamedTuple

from .pipeline import OP_NAMES, _as_fn, _event

LAYOUTS = ("loop", "v", "dual")


class LaidOut(NamedTuple):
    ops: list                # per rank: [(kind, micro-batch, chunk), ...]
    layout: str              # "loop", "v" or "dual"
    microbatches: int
    chunks: int = 1          # chunks per rank (2 for "v" and "dual")
    slots: tuple = ()        # per rank: ((i, n), ...): ops i .. i+n-1 run as one slot


def route(layout, stages, microbatches, m, chunks=1):
    """The (rank, chunk) pairs micro-batch m visits in its forward, in order."""
    p = stages
    if layout == "loop":
        return [(s % p, s // p) for s in range(p * chunks)]
    if layout == "v":
        return [(s, 0) for s in range(p)] + [(p - 1 - s, 1) for s in range(p)]
    if layout == "dual":
        return ([(r, 0) for r in range(p)] if m < microbatches // 2 else
                [(p - 1 - r, 1) for r in range(p)])
    raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")


def _positions(sched):
    """(m, rank, chunk) -> the index of that hop in m's route."""
    p = len(sched.ops)
    return {(m, r, c): k for m in range(sched.microbatches)
            for k, (r, c) in enumerate(route(sched.layout, p, sched.microbatches, m,
                                             sched.chunks))}


def check_laid_out(sched):
    """Raise ValueError (one line) unless every rank runs F, B and W of each hop it holds
    exactly once, F before B before W, and the schedule runs to the end (no deadlock)."""
    where = _positions(sched)
    for rank, ops in enumerate(sched.ops):
        want = {(kind, m, c) for (m, r, c) in where if r == rank for kind in "FBW"}
        seen = set()
        for op in ops:
            kind, m, c = op
            if op not in want:
                raise ValueError(f"rank {rank} runs {kind}{m}.{c}, not a hop of its layout")
            if op in seen:
                raise ValueError(f"rank {rank} runs {kind}{m}.{c} twice")
            before = {"B": "F", "W": "B"}.get(kind)
            if before and (before, m, c) not in seen:
                raise ValueError(f"rank {rank} runs {kind}{m}.{c} before {before}{m}.{c}")
            seen.add(op)
        if want - seen:
            kind, m, c = sorted(want - seen)[0]
            raise ValueError(f"rank {rank} never runs {kind}{m}.{c}")
    try:
        simulate_laid_out(sched, 1.0, 1.0, 1.0)
    except RuntimeError as error:
        raise ValueError(str(error)) from None


def simulate_laid_out(sched, t_forward, t_backward_input, t_weight, t_comm=0.0):
    """Replay a `LaidOut` schedule like `pipeline.simulate_schedule` (an op starts when its
    rank is free and its input has arrived; an F&B slot when both of its inputs have): the
    same timeline events (meta: microbatch, stage = hop index on its route, chunk)."""
    p = len(sched.ops)
    where = _positions(sched)
    at = {(m, k): rc for (m, *rc), k in where.items()}
    times = {"F": _as_fn(t_forward), "B": _as_fn(t_backward_input), "W": _as_fn(t_weight)}
    last = {m: max(k for (mm, _, _), k in where.items() if mm == m)
            for m in range(sched.microbatches)}
    spans = [dict(sched.slots[r]) if sched.slots else {} for r in range(p)]
    done, pos, free, timeline = {}, [0] * p, [0.0] * p, []

    def ready(rank, op, inside=()):
        """When op's inputs (but those made `inside` its slot) are there, else None."""
        kind, m, c = op
        k = where[(m, rank, c)]
        own = {"F": None, "B": ("F", m, k), "W": ("B", m, k)}[kind]
        peer = {"F": k - 1 if k > 0 else None,
                "B": k + 1 if k < last[m] else None, "W": None}[kind]
        needs = [(own, False)] if own else []
        if peer is not None:
            needs.append(((kind, m, peer), at[(m, peer)][0] != rank))
        needs = [(key, remote) for key, remote in needs if key not in inside]
        if any(key not in done for key, _ in needs):
            return None
        return max([done[key] + (t_comm if remote else 0.0) for key, remote in needs] + [0.0])

    while any(pos[r] < len(sched.ops[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(sched.ops[r]):
                i = pos[r]
                slot = sched.ops[r][i:i + spans[r].get(i, 1)]
                inside = {(kind, m, where[(m, r, c)]) for kind, m, c in slot}
                starts = [ready(r, op, inside) for op in slot]
                if any(s is None for s in starts):
                    break
                t = max([free[r]] + starts)
                if t > free[r]:
                    timeline.append(_event(r, "idle", "wait", free[r], t, {}))
                keys = []
                for kind, m, c in slot:
                    k = where[(m, r, c)]
                    end = t + times[kind](r, c)
                    timeline.append(_event(r, "compute", OP_NAMES[kind], t, end,
                                           dict(microbatch=m, stage=k, chunk=c)))
                    keys.append((kind, m, k))
                    done[keys[-1]], t = end, end
                for key in keys:        # a slot's outputs leave together, at its end
                    done[key] = t
                free[r], pos[r], progressed = t, i + len(slot), True
        if not progressed:
            stuck = [f"rank {r} at {''.join(map(str, sched.ops[r][pos[r]][:2]))}"
                     for r in range(p) if pos[r] < len(sched.ops[r])]
            raise RuntimeError("deadlock: every rank waits for an op that never comes: "
                               + ", ".join(stuck))
    return timeline


def idle_per_rank(timeline):
    """Each rank's idle time within the step (first op anywhere to last op anywhere)."""
    ops = [e for e in timeline if e["kind"] == "compute"]
    start, end = min(e["start"] for e in ops), max(e["end"] for e in ops)
    ranks = sorted({e["rank"] for e in ops})
    return [end - start - sum(e["end"] - e["start"] for e in ops if e["rank"] == r)
            for r in ranks]


def activations_held(sched, until="W"):
    """Per rank, the most micro-batch hops whose activations it holds at once (F done, its
    W not yet; until="B": its B not yet), in units of one micro-batch through one stage of
    the P-stage model (a "v" chunk is half a stage)."""
    scale = 0.5 if sched.layout == "v" else 1.0 / sched.chunks if sched.layout == "loop" else 1
    out = []
    for ops in sched.ops:
        held, most = set(), 0
        for kind, m, c in ops:
            if kind == "F":
                held.add((m, c))
                most = max(most, len(held))
            elif kind == until:
                held.discard((m, c))
        out.append(most * scale)
    return out


# ============================================================ DualPipe as data

def dualpipe_schedule(stages, microbatches):
    """DualPipe's order (DeepSeek-V3 report sec. 3.2.1, Figure 5; its public implementation
    deepseek-ai/DualPipe), in 8 steps per rank. h = min(r, P-1-r) is the rank's distance from
    the nearer end, H = P/2. "near" is the direction that enters at the nearer end (direction 0
    on the first half of the ranks, 1 on the second), "far" the other:
    1: 2(H-h-1) F near   2: h+1 times (F near, F far)   3: H-h-1 times (B far, W, F far)
    4: M/2-P+h+1 times (F near & B far, F far & B near)   5: H-h-1 times (B far, F far & B near)
    6: h+1 times (B far, B near)   7: H-h-1 times (W, B near)   8: h+1 times W.
    Backwards are full (B then W at once) except where zero bubble is on: in 3, from the
    middle of 6 on, and in 7; their W's wait in a queue that W pops, oldest first. In 4 the
    middle ranks do not overlap the first pair (they would wait on each other)."""
    p, m_total = stages, microbatches
    if p < 2 or p % 2:
        raise ValueError(f"DualPipe needs an even number of ranks >= 2, got P={p}")
    if m_total % 2 or m_total < 2 * p:
        raise ValueError(f"DualPipe needs an even M >= 2P micro-batches (half from each end), "
                         f"got M={m_total} for P={p}")
    half_p, half_m = p // 2, m_total // 2
    ops, slots = [], []
    for rank in range(p):
        h = min(rank, p - 1 - rank)
        near = 0 if rank < half_p else 1          # the direction entering at this half's end
        count = {"F": [0, 0], "B": [0, 0]}
        mine, spans, queue = [], [], []

        def op(kind, side):
            direction = near if side == "near" else 1 - near
            index = count[kind][direction]
            count[kind][direction] += 1
            return (kind, index + direction * half_m, direction)

        def forward(side):
            mine.append(op("F", side))

        def backward(side, zero_bubble=False, in_slot=False):
            b = op("B", side)
            if zero_bubble:
                mine.append(b)
                queue.append(("W",) + b[1:])
                return
            if not in_slot:                       # a full backward: one slot B, W
                spans.append((len(mine), 2))
            mine.extend([b, ("W",) + b[1:]])

        def weight():
            if queue:
                mine.append(queue.pop(0))

        def overlap(f_side, b_side):              # one slot F, B, W
            spans.append((len(mine), 3))
            forward(f_side)
            backward(b_side, in_slot=True)

        for _ in range(2 * (half_p - h - 1)):
            forward("near")
        for _ in range(h + 1):
            forward("near")
            forward("far")
        for _ in range(half_p - h - 1):
            backward("far", zero_bubble=True)
            weight()
            forward("far")
        for i in range(half_m - p + h + 1):
            if i == 0 and h == half_p - 1:          # a middle rank: no overlap here
                forward("near")
                backward("far")
            else:
                overlap("near", "far")
            overlap("far", "near")
        for _ in range(half_p - h - 1):
            backward("far")
            overlap("far", "near")
        zero_bubble = False
        for i in range(h + 1):
            if i == (h + 1) // 2 and h % 2 == 1:
                zero_bubble = True
            backward("far", zero_bubble)
            if i == (h + 1) // 2 and h % 2 == 0:
                zero_bubble = True
            backward("near", zero_bubble)
        for _ in range(half_p - h - 1):
            weight()
            backward("near", zero_bubble=True)
        for _ in range(h + 1):
            weight()
        ops.append(mine)
        slots.append(tuple(spans))
    return LaidOut(ops, "dual", m_total, 2, tuple(slots))


def table2_idle(schedule, stages, t_forward, t_backward_input, t_weight, t_overlap=None):
    """The report's Table 2 idle per rank. t_overlap: one F&B slot (default, free links:
    T_F + T_B + T_W); the table's B is the full backward T_B + T_W."""
    f, b, w = t_forward, t_backward_input + t_weight, t_weight
    fb = f + b if t_overlap is None else t_overlap
    if schedule == "1f1b":
        return (stages - 1) * (f + b)
    if schedule == "zb1p":
        return (stages - 1) * (f + b - 2 * w)
    if schedule == "dualpipe":
        return (stages / 2 - 1) * (fb + b - 3 * w)
    raise ValueError(f"schedule must be '1f1b', 'zb1p' or 'dualpipe', not {schedule!r}")


def from_loop(schedule):
    """A `labkit.theory.pipeline` schedule (looped layout) as a `LaidOut`; in a schedule
    without W ops each B becomes a full backward (a slot B, W)."""
    split = any(k == "W" for ops in schedule for k, _, _ in ops)
    ops, slots = [], []
    for rank_ops in schedule:
        mine, spans = [], []
        for kind, m, c in rank_ops:
            if kind == "B" and not split:
                spans.append((len(mine), 2))
                mine.extend([(kind, m, c), ("W", m, c)])
            else:
                mine.append((kind, m, c))
        ops.append(mine)
        slots.append(tuple(spans))
    flat = [op for rank_ops in ops for op in rank_ops]
    return LaidOut(ops, "loop", 1 + max(m for _, m, _ in flat),
                   1 + max(c for _, _, c in flat), tuple(slots))
