"""Pipeline schedules as data, a simulator that replays them, and the bubble.

A pipeline cuts a model into S = P x V contiguous stages over P ranks: stage s lives on rank
s % P as that rank's chunk s // P (V = 1: one stage per rank; V > 1: Megatron-LM's interleaving).
A *schedule* is plain data: for every rank, the ordered list of its ops ("F", micro-batch,
chunk) and ("B", micro-batch, chunk). The executor (`labkit.parallel.pipeline`) runs any such
list; `simulate_schedule` replays one in pure Python with the executor's timing rules.

Bubble (idle share of a step, GPipe's convention), with equal stages and free links:
(P-1)/(V*M + P-1) (GPipe, Huang et al. 2019, arXiv 1811.06965; interleaved 1F1B, Narayanan
et al. 2021, arXiv 2104.04473). Memory: GPipe keeps M micro-batches' activations on every stage,
1F1B (PipeDream-Flush, Narayanan et al. 2021, arXiv 2006.09503) at most P - r on rank r.

Zero bubble (Qi et al. 2023, arXiv 2401.10241): split each backward into B, the input gradient
(the next stage waits for it), and W, the weight gradient (nobody waits for it), and move the
W's into the bubbles. A split schedule has ("W", micro-batch, chunk) ops too, each after its B.
ZB-H1 keeps 1F1B's activation memory (at most P - r micro-batches between F and W on rank r)
and idles (P-1)(T_F + T_B - T_W) per rank instead of 1F1B's (P-1)(T_F + T_B + T_W).
No torch and no torch.distributed here: the widgets and the planner use it too.
"""
from __future__ import annotations

import math

from .hardware import Cluster, Link, cluster
from .time import bubble_fraction

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")


# ================================================================ schedules as data

def naive_schedule(stages):
    """One batch, no micro-batches: forward through every stage, then backward."""
    return gpipe_schedule(stages, 1)


def gpipe_schedule(stages, microbatches):
    """GPipe: all M forwards, then all M backwards, on every stage."""
    return [[("F", m, 0) for m in range(microbatches)] +
            [("B", m, 0) for m in range(microbatches)] for _ in range(stages)]


def one_f_one_b_schedule(stages, microbatches):
    """1F1B: rank r runs P-r-1 warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards."""
    schedule = []
    for rank in range(stages):
        warmup = min(stages - rank - 1, microbatches)
        ops = [("F", m, 0) for m in range(warmup)]
        for i in range(microbatches - warmup):
            ops += [("F", warmup + i, 0), ("B", i, 0)]
        ops += [("B", m, 0) for m in range(microbatches - warmup, microbatches)]
        schedule.append(ops)
    return schedule


def interleaved_schedule(stages, microbatches, virtual):
    """Interleaved 1F1B: V chunks per rank; micro-batches go through the chunks in groups of P.
    M must be a multiple of P (as in Megatron-LM)."""
    p, m_total, v = stages, microbatches, virtual
    if v < 1:
        raise ValueError(f"interleaved needs at least 1 chunk per rank, got {v}")
    if m_total % p:
        raise ValueError(f"interleaved needs micro-batches ({m_total}) to be a multiple of the "
                         f"stages ({p}); with fewer, the chunks wait on each other")

    def op(kind, k):  # the k-th forward (or backward) on a rank: which micro-batch and chunk
        group, within = divmod(k, p * v)
        chunk = within // p
        return (kind, group * p + within % p, chunk if kind == "F" else v - 1 - chunk)

    schedule, total = [], m_total * v
    for rank in range(p):
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        ops = [op("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [op("F", warmup + k), op("B", k)]
        ops += [op("B", k) for k in range(total - warmup, total)]
        schedule.append(ops)
    return schedule


def zb_h1_schedule(stages, microbatches):
    """ZB-H1 (Qi et al. 2023, sec. 3.1): stage i runs, for x = 0 .. M+P-2, the ops
    F_x, B_(x-(P-1-i)), W_(x-(P-1)) that exist (index in 0..M-1), in that order. Its B's are
    1F1B's (P - i micro-batches between F and B, 1F1B's activation memory); each W waits P-1
    slots, filling the tail where 1F1B idles (the W's inputs stay until then: P micro-batches
    between F and W on every stage, 1F1B's peak, that of stage 0)."""
    p, m = stages, microbatches
    if p < 1 or m < 1:
        raise ValueError(f"a pipeline needs >= 1 rank and >= 1 micro-batch, got P={p}, M={m}")
    schedule = []
    for i in range(p):
        ops = []
        for x in range(m + p - 1):
            for kind, index in (("F", x), ("B", x - (p - 1 - i)), ("W", x - (p - 1))):
                if 0 <= index < m:
                    ops.append((kind, index, 0))
        schedule.append(ops)
    return schedule


def zb_h1_idle_per_rank(stages, t_forward, t_backward_input, t_weight):
    """The paper's idle time per rank: ZB-H1 (P-1)(T_F + T_B - T_W) (T_W <= T_F, T_B;
    M >= P micro-batches)."""
    return (stages - 1) * (t_forward + t_backward_input - t_weight)


def split_bubble_formula(stages, microbatches, t_forward, t_backward_input, t_weight,
                         schedule="zb-h1"):
    """Idle share of a step: idle / (M (T_F + T_B + T_W) + idle), with the idle per rank of
    ZB-H1 or of 1F1B ((P-1)(T_F + T_B + T_W), i.e. (P-1)/(M+P-1))."""
    work = t_forward + t_backward_input + t_weight
    idle = ((stages - 1) * work if schedule == "1f1b" else
            zb_h1_idle_per_rank(stages, t_forward, t_backward_input, t_weight))
    return idle / (microbatches * work + idle)


def make_schedule(name, stages, microbatches, virtual=1):
    """The schedule called `name` for `stages` ranks (P), M micro-batches, V chunks per rank."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {name!r}")
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a pipeline needs >= 1 rank and >= 1 micro-batch, got P={stages}, "
                         f"M={microbatches}")
    if name != "interleaved" and virtual != 1:
        raise ValueError(f"{name} runs one chunk per rank (V=1); V={virtual} needs "
                         f"'interleaved'")
    if name == "naive":
        return naive_schedule(stages)
    if name == "gpipe":
        return gpipe_schedule(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b_schedule(stages, microbatches)
    return interleaved_schedule(stages, microbatches, virtual)


def schedule_shape(schedule):
    """(P ranks, M micro-batches, V chunks per rank) that a schedule covers."""
    ops = [op for rank_ops in schedule for op in rank_ops]
    return (len(schedule), 1 + max((m for _, m, _ in ops), default=-1),
            1 + max((c for _, _, c in ops), default=0))


def check_schedule(schedule, microbatches=None, virtual=None):
    """Raise ValueError (one line, naming the first problem) unless `schedule` can run:
    every rank runs F and B of every (micro-batch, chunk) exactly once, each F before its B,
    and no rank waits forever (replayed by the simulator). Returns (P, M, V)."""
    p, m_found, v_found = schedule_shape(schedule)
    m = m_found if microbatches is None else microbatches
    v = v_found if virtual is None else virtual
    kinds = "FBW" if is_split(schedule) else "FB"
    want = {(kind, i, c) for kind in kinds for i in range(m) for c in range(v)}
    for rank, ops in enumerate(schedule):
        seen = set()
        for op in ops:
            kind, i, c = op
            if op not in want:
                raise ValueError(f"rank {rank} runs {kind}{i}.{c}, which is not an op of a "
                                 f"schedule of {m} micro-batches and {v} chunk(s) per rank")
            if op in seen:
                raise ValueError(f"rank {rank} runs {kind}{i}.{c} twice")
            if kind == "B" and ("F", i, c) not in seen:
                raise ValueError(f"rank {rank} runs B{i}.{c} before F{i}.{c}: a backward needs "
                                 "the activations its forward saved")
            if kind == "W" and ("B", i, c) not in seen:
                raise ValueError(f"rank {rank} runs W{i}.{c} before B{i}.{c}: the weight "
                                 "gradient needs the output gradient B computes")
            seen.add(op)
        missing = sorted(want - seen)
        if missing:
            kind, i, c = missing[0]
            raise ValueError(f"rank {rank} never runs {kind}{i}.{c} ({len(missing)} op(s) "
                             f"missing): every micro-batch needs one {' and one '.join(kinds)} "
                             "on every stage")
    try:
        simulate_schedule(schedule, 1.0, 2.0, t_weight=1.0)
    except RuntimeError as error:
        raise ValueError(str(error)) from None
    return p, m, v


def messages_to(schedule, me):
    """What each other rank sends rank `me`, in the order it sends:
    {peer: [("act" | "grad", micro-batch, chunk on `me`), ...]}. Both ends of a link know the
    whole schedule, so the receiver can match each message to its op, whatever the order."""
    p, _, v = schedule_shape(schedule)
    out = {}
    for peer, ops in enumerate(schedule):
        for kind, m, c in ops:
            if kind == "W":      # a weight gradient stays on its rank
                continue
            stage = c * p + peer
            target = stage + 1 if kind == "F" else stage - 1
            if 0 <= target < p * v and target % p == me and peer != me:
                out.setdefault(peer, []).append(("act" if kind == "F" else "grad", m,
                                                 target // p))
    return out


def format_schedule(schedule):
    """The schedule as a text table: one row per rank, one column per slot ('F3' or 'B3.1')."""
    chunks = max((c for ops in schedule for _, _, c in ops), default=0) > 0
    cells = [[f"{k}{m}" + (f".{c}" if chunks else "") for k, m, c in ops] for ops in schedule]
    width = max(len(c) for row in cells for c in row) if any(cells) else 2
    lines = ["slot:   " + " ".join(f"{i:>{width}}" for i in range(max(map(len, cells))))]
    for rank, row in enumerate(cells):
        lines.append(f"rank {rank}: " + " ".join(f"{c:>{width}}" for c in row))
    if chunks:
        lines.append("(Fm.c: forward of micro-batch m through this rank's chunk c)")
    return "\n".join(lines)


def print_schedule(schedule):
    print(format_schedule(schedule))


def is_split(schedule):
    """True when the backward is split into B (input gradient) and W (weight gradient)."""
    return any(kind == "W" for ops in schedule for kind, _, _ in ops)


def microbatches_in_flight(ops, until=None):
    """The most micro-batch chunks a rank holds activations for at once: F done, and its B
    not yet (W, when the backward is split: the weight gradient needs the saved inputs;
    until="B" counts a split schedule's micro-batches up to their B)."""
    release = until or ("W" if any(kind == "W" for kind, _, _ in ops) else "B")
    held, most = set(), 0
    for kind, m, c in ops:
        if kind == "F":
            held.add((m, c))
            most = max(most, len(held))
        elif kind == release:
            held.discard((m, c))
    return most


# ========================================================================= the simulator

def simulate_schedule(schedule, t_forward, t_backward, t_comm=0.0, t_weight=None):
    """Replay `schedule` with the executor's timing rules, in pure Python, instantly.

    An op starts when its rank is free and its input has arrived (sender's finish + t_comm);
    sends never block. t_forward / t_backward (/ t_weight, for split schedules, where
    t_backward is the input gradient B only): seconds per op, a number or a function
    (rank, chunk) -> seconds. Returns a timeline like `ctx.clock.timeline()` (compute lane:
    forward, backward, weight grad, idle). Raises RuntimeError naming the stuck ops on a
    deadlock.
    """
    p, _, v_count = schedule_shape(schedule)
    if t_weight is None and is_split(schedule):
        raise ValueError("the schedule has W (weight-gradient) ops: pass t_weight")
    times = {"F": _as_fn(t_forward), "B": _as_fn(t_backward),
             "W": _as_fn(t_weight if t_weight is not None else 0.0)}
    done = {}                      # (kind, m, stage) -> finish time
    pos, free = [0] * p, [0.0] * p
    timeline = []
    while any(pos[r] < len(schedule[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                kind, m, c = schedule[r][pos[r]]
                v = c * p + r
                if kind == "F":
                    needs = ("F", m, v - 1) if v > 0 else None
                elif kind == "B":
                    needs = ("B", m, v + 1) if v < p * v_count - 1 else None
                else:
                    needs = None
                own = {"F": None, "B": ("F", m, v), "W": ("B", m, v)}[kind]
                if (needs and needs not in done) or (own and own not in done):
                    break
                local = needs is not None and (needs[2] % p) == r
                ready = done[needs] + (0.0 if local else t_comm) if needs else 0.0
                start = max(free[r], ready)
                if start > free[r]:
                    timeline.append(_event(r, "idle", "wait", free[r], start, {}))
                end = start + times[kind](r, c)
                timeline.append(_event(r, "compute", OP_NAMES[kind], start, end,
                                       dict(microbatch=m, stage=v, chunk=c)))
                done[(kind, m, v)], free[r] = end, end
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r} at {schedule[r][pos[r]][0]}{schedule[r][pos[r]][1]}"
                     f".{schedule[r][pos[r]][2]}" for r in range(p) if pos[r] < len(schedule[r])]
            raise RuntimeError("deadlock: every rank waits for an op that never comes: "
                               + ", ".join(stuck))
    return timeline


OP_NAMES = {"F": "forward", "B": "backward", "W": "weight grad"}


def _as_fn(value):
    return value if callable(value) else (lambda rank, chunk: value)


def _event(rank, kind, name, start, end, meta):
    return dict(rank=rank, lane="compute", kind=kind, name=name, start=start, end=end,
                wall_start=0.0, wall_end=0.0, meta=meta)


def pipeline_ops(timeline):
    """The forward and backward bars of a timeline (a run's or the simulator's)."""
    return [e for e in timeline if e["lane"] == "compute" and e["kind"] == "compute"
            and e["name"] in OP_NAMES.values()]


def timeline_bubble_fraction(timeline, ranks=None):
    """The bubble read off a timeline (modelled or simulated, never wall time):
    1 - (forward + backward time, summed over ranks) / (ranks x span from first op to last).
    With equal per-stage op times and free links this is `bubble_formula(P, M, V)`."""
    ops = pipeline_ops(timeline)
    if not ops:
        return float("nan")
    ranks = ranks or len({e["rank"] for e in ops})
    span = max(e["end"] for e in ops) - min(e["start"] for e in ops)
    busy = sum(e["end"] - e["start"] for e in ops)
    return 1.0 - busy / (ranks * span) if span > 0 else 0.0


def bubble_formula(stages, microbatches, virtual=1):
    """(P-1)/(V*M + P-1): the idle share with equal stages and free links (theory.time)."""
    return bubble_fraction(stages, microbatches, virtual)


def bubble_formula_text(schedule, virtual=1):
    """The formula that holds for `schedule`, as a learner reads it."""
    if schedule == "naive":
        return "(P-1)/P (one batch, M = 1)"
    if schedule == "interleaved":
        return f"(P-1)/(V·M+P-1), V = {virtual}"
    return "(P-1)/(M+P-1)"


def op_times(timeline):
    """Mean seconds of each (kind, rank, chunk) op in a timeline."""
    sums = {}
    for e in pipeline_ops(timeline):
        key = (e["name"], e["rank"], e["meta"].get("chunk", 0))
        total, n = sums.get(key, (0.0, 0))
        sums[key] = (total + e["end"] - e["start"], n + 1)
    return {k: total / n for k, (total, n) in sums.items()}


def simulate_like(timeline, schedule, t_comm=0.0):
    """Simulate `schedule` with the op times of a run's `timeline`."""
    times = op_times(timeline)
    weight = (lambda r, c: times[("weight grad", r, c)]) if is_split(schedule) else None
    return simulate_schedule(schedule, lambda r, c: times[("forward", r, c)],
                             lambda r, c: times.get(("backward", r, c), 0.0), t_comm, weight)


def comm_free_cluster(base="8xH100-NVLink"):
    """`base` with a link that costs nothing (no latency, infinite bandwidth): the setting in
    which the bubble formula holds, since it counts compute only."""
    c = cluster(base)
    free = Link("free link (no latency, infinite bandwidth)", math.inf, 0.0, 1.0)
    return Cluster(f"{c.name} (free links)", c.gpu, c.gpus_per_node, c.nodes, free,
                   free if c.inter else None, c.mfu)


# ========================================================================= splitting

def balanced_split(weights, parts):
    """Contiguous groups of `weights` (e.g. parameter counts) into `parts`, minimising the
    heaviest group; returns the group sizes, e.g. [2, 2]. Each group gets at least one."""
    n = len(weights)
    if parts < 1:
        raise ValueError(f"need at least 1 pipeline stage, got {parts}")
    if n < parts:
        raise ValueError(f"{n} layers cannot fill {parts} pipeline stages (need >= 1 each)")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the lightest 'heaviest group' for the first i layers in k groups
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]
