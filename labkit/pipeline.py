"""Pipeline parallelism: each rank holds a contiguous slice of the layers (a stage); micro-batches
flow forward as activations (send/recv) and backward as activation gradients.

Memory per rank: Ψ/P weights, grads and optimizer state, plus activations of the micro-batches in
flight (GPipe: all M, 1F1B: at most P). Comm per step: each stage boundary carries the batch's
activations once forward and its gradients once back. Idle share (bubble): (P-1)/(V*M + P-1).

A schedule is plain data: for every rank, the ordered list of ops ("F", microbatch, chunk) and
("B", microbatch, chunk). `run_schedule` runs any schedule; `simulate_schedule` replays one in
pure Python with the same timing rules, instantly (for widgets and for checking a schedule).
"""
from __future__ import annotations

import math
from collections import deque

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import models
from .runs import reference
from .theory import hardware
from .theory import memory as theory_memory
from .theory import time as theory_time

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")


# ================================================================== splitting into stages

def balanced_split(weights, parts):
    """Contiguous groups of `weights` (e.g. parameter counts) into `parts`, minimising the
    heaviest group; returns the group sizes, e.g. [2, 2]. Each group gets at least one."""
    n = len(weights)
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


def model_units(model):
    """The model as a list of layers to split: (names of the modules in it, parameter count).

    TinyGPT: its blocks; the embeddings ride with the first block, ln_f + head with the last.
    MLP: its Linear layers."""
    if isinstance(model, models.TinyGPT):
        units = [[f"blocks.{i}"] for i in range(len(model.blocks))]
        units[0] = ["tok", "pos"] + units[0]
        units[-1] = units[-1] + ["ln_f", "head"]
    elif isinstance(model, models.MLP):
        units = [[f"layers.{i}"] for i in range(len(model.layers))]
    else:
        raise TypeError(f"pipeline knows TinyGPT and MLP, not {type(model).__name__}")
    return [(names, sum(p.numel() for n in names for p in model.get_submodule(n).parameters()))
            for names in units]


def stage_layout(model, stages, virtual=1, split=None):
    """Which units each virtual stage holds: a list of P*V lists of module names.

    Virtual stage v lives on rank v % P as its chunk v // P (Megatron-LM's interleaving).
    `split` gives the number of units per virtual stage; default: balanced by parameter count.
    """
    units = model_units(model)
    sizes = list(split) if split is not None else balanced_split([w for _, w in units],
                                                                 stages * virtual)
    if len(sizes) != stages * virtual or sum(sizes) != len(units) or min(sizes) < 1:
        raise ValueError(f"split {sizes} must give {stages * virtual} stages of >= 1 layer "
                         f"each, {len(units)} layers in all")
    layout, start = [], 0
    for size in sizes:
        layout.append([name for names, _ in units[start:start + size] for name in names])
        start += size
    return layout


class GPTChunk(nn.Module):
    """A slice of a TinyGPT. Submodules keep their names (blocks.3.attn.qkv.weight, ...)."""

    def __init__(self, model, names):
        super().__init__()
        self.cfg = model.cfg
        self.blocks = nn.ModuleDict()
        for name in names:
            if name.startswith("blocks."):
                self.blocks[name.split(".")[1]] = model.get_submodule(name)
            else:
                setattr(self, name, model.get_submodule(name))
        self.first, self.last = hasattr(self, "tok"), hasattr(self, "head")

    def forward(self, x, targets=None):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def in_shape(self, batch):
        return (batch, self.cfg.seq, self.cfg.hidden)

    out_shape = in_shape


class MLPChunk(nn.Module):
    """A slice of an MLP: some of its Linear layers (GELU after all but the model's last)."""

    def __init__(self, model, names):
        super().__init__()
        self.layers = nn.ModuleDict({n.split(".")[1]: model.get_submodule(n) for n in names})
        self.n_layers = len(model.layers)
        self.first, self.last = "0" in self.layers, str(self.n_layers - 1) in self.layers

    def forward(self, x, targets=None):
        for index, layer in self.layers.items():
            x = layer(x)
            if int(index) < self.n_layers - 1:
                x = F.gelu(x)
        return x if targets is None or not self.last else F.mse_loss(x, targets)

    def in_shape(self, batch):
        return (batch, next(iter(self.layers.values())).in_features)

    def out_shape(self, batch):
        return (batch, list(self.layers.values())[-1].out_features)


def build_chunks(model, rank, stages, virtual=1, split=None):
    """This rank's V chunks of `model` (built with the reference seed on every rank)."""
    layout = stage_layout(model, stages, virtual, split)
    kind = GPTChunk if isinstance(model, models.TinyGPT) else MLPChunk
    return [kind(model, layout[c * stages + rank]) for c in range(virtual)]


# ======================================================================= schedules as data

def naive_schedule(stages):
    """One batch, no micro-batches: forward through every stage, then backward."""
    return gpipe_schedule(stages, 1)


def gpipe_schedule(stages, microbatches):
    """GPipe (Huang et al. 2019): all M forwards, then all M backwards, on every stage."""
    return [[("F", m, 0) for m in range(microbatches)] +
            [("B", m, 0) for m in range(microbatches)] for _ in range(stages)]


def one_f_one_b_schedule(stages, microbatches):
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): stage r runs P-r-1 warm-up forwards,
    then alternates one forward and one backward, then drains the remaining backwards."""
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
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): V chunks per rank; micro-batches
    go through the chunks in groups of P. M must be a multiple of P (as in Megatron-LM)."""
    p, m_total, v = stages, microbatches, virtual
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


def make_schedule(name, stages, microbatches, virtual=1):
    if name == "naive":
        return naive_schedule(stages)
    if name == "gpipe":
        return gpipe_schedule(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b_schedule(stages, microbatches)
    if name == "interleaved":
        return interleaved_schedule(stages, microbatches, virtual)
    raise ValueError(f"schedule must be one of {SCHEDULES}, not {name!r}")


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


def microbatches_in_flight(ops):
    """The most micro-batch chunks a rank holds activations for at once (F done, B not yet)."""
    held, most = set(), 0
    for kind, m, c in ops:
        if kind == "F":
            held.add((m, c))
            most = max(most, len(held))
        else:
            held.discard((m, c))
    return most


def _messages_to(schedule, me, virtual):
    """What each peer sends `me`, in the order it sends: {peer: deque of (kind, m, chunk)}."""
    p = len(schedule)
    out = {}
    for peer, ops in enumerate(schedule):
        for kind, m, c in ops:
            v = c * p + peer
            target = v + 1 if kind == "F" else v - 1
            if 0 <= target < p * virtual and target % p == me:
                key = ("act" if kind == "F" else "grad", m, target // p)
                out.setdefault(peer, deque()).append(key)
    return out


# ============================================================================ the executor

class _Inbox:
    """Receive messages in the order each peer sends them (both sides know the whole schedule),
    keeping any that arrive before they are needed. Any schedule is then matched correctly."""

    def __init__(self, ctx, schedule, chunks, batch):
        self.ctx, self.chunks, self.batch = ctx, chunks, batch
        self.expected = _messages_to(schedule, ctx.rank, len(chunks))
        self.waiting = {}

    def get(self, key, peer):
        while key not in self.waiting:
            queue = self.expected.get(peer)
            if not queue:
                raise RuntimeError(f"rank {self.ctx.rank} needs {key} from rank {peer}, but "
                                   f"rank {peer}'s schedule never sends it")
            kind, m, c = queue.popleft()
            chunk = self.chunks[c]
            shape = chunk.in_shape(self.batch) if kind == "act" else chunk.out_shape(self.batch)
            self.ctx.comm.tag = f"{kind} of micro-batch {m}, chunk {c}"
            buffer = torch.empty(shape, device=self.ctx.device)
            self.waiting[(kind, m, c)] = self.ctx.comm.recv(buffer, peer)
        return self.waiting.pop(key)


def run_schedule(ctx, chunks, schedule, microbatches, recompute=False):
    """Run this rank's ops of `schedule` (a list of per-rank op lists) on its `chunks`.

    microbatches: list of (input, target); the first stage reads inputs, the last targets.
    F: receive the activation, run forward (kept for B), send the output on.
    B: receive the output's gradient, run backward, send the input's gradient back.
    The loss is the mean over micro-batches, so gradients equal the full batch's.
    recompute: keep only each stage input; B runs the forward again before backward.
    Returns {microbatch: loss} on the rank holding the last stage ({} elsewhere).
    """
    p, rank, v_count = len(schedule), ctx.rank, len(chunks)
    last_v, n_micro = p * v_count - 1, len(microbatches)
    batch = microbatches[0][0].shape[0]
    inbox = _Inbox(ctx, schedule, chunks, batch)
    saved, losses, sends = {}, {}, []
    for kind, m, c in schedule[rank]:
        v, chunk = c * p + rank, chunks[c]
        x_in, target = microbatches[m]
        meta = dict(microbatch=m, stage=v, chunk=c)
        if kind == "F":
            x = x_in if v == 0 else inbox.get(("act", m, c), (v - 1) % p).requires_grad_()
            with ctx.clock.compute("forward", **meta), torch.set_grad_enabled(not recompute):
                y = chunk(x, target if v == last_v else None)
            if v == last_v:
                losses[m] = y.item()
                y = y / n_micro
            else:
                ctx.comm.tag = f"act of micro-batch {m}, stage {v}"
                sends.append(ctx.comm.send(y.detach(), (v + 1) % p, async_op=True))
            saved[(m, c)] = (x, None if recompute else y)
            if recompute:
                ctx.memory.add_buffer(f"stage input {m}.{c}", x)
        elif kind == "B":
            if (m, c) not in saved:
                raise RuntimeError(f"rank {rank}: B{m}.{c} comes before F{m}.{c} in its schedule")
            x, y = saved.pop((m, c))
            grad = None if v == last_v else inbox.get(("grad", m, c), (v + 1) % p)
            with ctx.clock.compute("backward", recompute=recompute, **meta):
                if recompute:
                    ctx.memory.remove_buffer(f"stage input {m}.{c}")
                    y = chunk(x, target if v == last_v else None)
                    y = y / n_micro if v == last_v else y
                torch.autograd.backward(y, grad)
            if v > 0:
                ctx.comm.tag = f"grad of micro-batch {m}, stage {v}"
                sends.append(ctx.comm.send(x.grad, (v - 1) % p, async_op=True))
        else:
            raise ValueError(f"rank {rank}: unknown op {kind!r} (use 'F' or 'B')")
    for handle in sends:
        handle.wait()
    ctx.comm.tag = ""
    return losses


# ========================================================== the simulator and the bubble

def simulate_schedule(schedule, t_forward, t_backward, t_comm=0.0):
    """Replay `schedule` with the executor's timing rules, in pure Python, instantly.

    An op starts when its rank is free and its input has arrived (sender's finish + t_comm);
    sends never block. t_forward / t_backward: seconds per op, a number or a function
    (rank, chunk) -> seconds. Returns a timeline like `ctx.clock.timeline()` (compute lane:
    forward, backward, idle). Raises RuntimeError naming the stuck ops on a deadlock.
    """
    p = len(schedule)
    v_count = 1 + max((c for ops in schedule for _, _, c in ops), default=0)
    times = {"F": _as_fn(t_forward), "B": _as_fn(t_backward)}
    done = {}                      # (kind, m, virtual stage) -> finish time
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
                else:
                    needs = ("B", m, v + 1) if v < p * v_count - 1 else None
                own = ("F", m, v) if kind == "B" else None
                if (needs and needs not in done) or (own and own not in done):
                    break
                ready = done[needs] + t_comm if needs else 0.0
                start = max(free[r], ready)
                if start > free[r]:
                    timeline.append(_event(r, "idle", "wait", free[r], start, {}))
                end = start + times[kind](r, c)
                timeline.append(_event(r, "compute", "forward" if kind == "F" else "backward",
                                       start, end, dict(microbatch=m, stage=v, chunk=c)))
                done[(kind, m, v)], free[r] = end, end
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r} at {schedule[r][pos[r]][0]}{schedule[r][pos[r]][1]}"
                     f".{schedule[r][pos[r]][2]}" for r in range(p) if pos[r] < len(schedule[r])]
            raise RuntimeError("deadlock: every rank waits for an op that never comes: "
                               + ", ".join(stuck))
    return timeline


def _as_fn(value):
    return value if callable(value) else (lambda rank, chunk: value)


def _event(rank, kind, name, start, end, meta):
    return dict(rank=rank, lane="compute", kind=kind, name=name, start=start, end=end,
                wall_start=0.0, wall_end=0.0, meta=meta)


def _pipeline_ops(timeline):
    return [e for e in timeline if e["lane"] == "compute" and e["kind"] == "compute"
            and e["name"] in ("forward", "backward")]


def bubble_fraction(timeline, ranks=None):
    """Idle share of the compute lanes over the step (GPipe's convention):
    1 - (forward + backward time, summed over ranks) / (ranks x span from first op to last).

    With equal per-stage op times and free links this is (P-1)/(V*M + P-1)."""
    ops = _pipeline_ops(timeline)
    if not ops:
        return float("nan")
    ranks = ranks or len({e["rank"] for e in ops})
    span = max(e["end"] for e in ops) - min(e["start"] for e in ops)
    busy = sum(e["end"] - e["start"] for e in ops)
    return 1.0 - busy / (ranks * span) if span > 0 else 0.0


def op_times(timeline):
    """Mean modelled seconds of each (kind, rank, chunk) op in a run's timeline."""
    sums = {}
    for e in _pipeline_ops(timeline):
        key = (e["name"], e["rank"], e["meta"].get("chunk", 0))
        total, n = sums.get(key, (0.0, 0))
        sums[key] = (total + e["end"] - e["start"], n + 1)
    return {k: total / n for k, (total, n) in sums.items()}


def simulate_like(timeline, schedule, t_comm=0.0):
    """Simulate `schedule` with the op times measured in a run's `timeline`."""
    times = op_times(timeline)
    return simulate_schedule(schedule, lambda r, c: times[("forward", r, c)],
                             lambda r, c: times[("backward", r, c)], t_comm)


def comm_free_cluster(base="8xH100-NVLink"):
    """`base` with a link that costs nothing (no latency, infinite bandwidth): the setting in
    which GPipe's bubble formula holds, since it counts compute only."""
    c = hardware.cluster(base)
    free = hardware.Link("free link (no latency, infinite bandwidth)", math.inf, 0.0, 1.0)
    return hardware.Cluster(f"{c.name} (free links)", c.gpu, c.gpus_per_node, c.nodes, free,
                            free if c.inter else None, c.mfu)


# ============================================================ memory: measured vs formula

def chunk_activation_bytes(chunk, batch):
    """What one chunk saves for backward on a micro-batch of `batch` (formula, fp32).

    TinyGPT: per block 16sbh + as^2b elements (theory.memory.tiny_gpt_activation_bytes);
    plus the last stage's ln_f / head / log-softmax. MLP: each Linear's input and GELU's input.
    """
    if isinstance(chunk, GPTChunk):
        c = chunk.cfg
        kw = dict(seq=c.seq, batch=batch, hidden=c.hidden, heads=c.heads, vocab=c.vocab)
        per_block = (theory_memory.tiny_gpt_activation_bytes(layers=1, **kw)
                     - theory_memory.tiny_gpt_activation_bytes(layers=0, **kw))
        head = theory_memory.tiny_gpt_activation_bytes(layers=0, **kw) if chunk.last else 0
        return len(chunk.blocks) * per_block + head
    elements = 0
    for index, layer in chunk.layers.items():
        elements += layer.in_features
        if int(index) < chunk.n_layers - 1:
            elements += layer.out_features          # GELU's input
        else:
            elements += 2 * layer.out_features      # MSE keeps output and target
    return 4 * batch * elements


def predicted_activation_bytes(schedule, rank, chunks, batch, recompute=False):
    """Most activation bytes held at once on `rank`: the schedule's in-flight micro-batches
    times each chunk's bytes (GPipe: M micro-batches, 1F1B: min(M, P - rank)). With recompute
    only one chunk's forward is saved at a time, during its backward (the stage inputs kept
    meanwhile are counted as buffers)."""
    if recompute:
        return max(chunk_activation_bytes(c, batch) for c in chunks)
    held, now, most = set(), 0, 0
    for kind, m, c in schedule[rank]:
        size = chunk_activation_bytes(chunks[c], batch)
        if kind == "F":
            held.add((m, c))
            now += size
            most = max(most, now)
        elif (m, c) in held:
            held.discard((m, c))
            now -= size
    return most


# ======================================================================= a training run

def train(ctx, cfg, schedule="1f1b", microbatches=4, virtual=1, recompute=False, split=None):
    """Train `cfg` with the pipeline on ctx.world_size stages; returns this rank's result.

    `schedule` is a name or a schedule (list of per-rank op lists, e.g. a learner's own).
    """
    from .runs.report import rank_result
    p = ctx.world_size
    if isinstance(schedule, str):
        if schedule == "naive":
            microbatches = 1
        virtual = virtual if schedule == "interleaved" else 1
        ops = make_schedule(schedule, p, microbatches, virtual)
    else:
        ops = [list(map(tuple, r)) for r in schedule]
        if len(ops) != p:
            raise ValueError(f"the schedule has {len(ops)} ranks, the run {p}")
    if cfg.global_batch % microbatches:
        raise ValueError(f"global batch {cfg.global_batch} does not split into "
                         f"{microbatches} equal micro-batches")
    model = reference.build_model(cfg)
    batches = [reference.batch(model, cfg, step) for step in range(cfg.steps)]
    chunks = build_chunks(model, ctx.rank, p, virtual, split)
    del model  # only this rank's chunks stay alive
    stage = nn.ModuleList(chunks)
    optimizer = reference.build_optimizer(stage.parameters(), cfg)
    ctx.memory.watch(model=stage, optimizer=optimizer)
    losses = []
    for step, (x, y) in enumerate(batches):
        micro = list(zip(x.chunk(microbatches), y.chunk(microbatches)))
        optimizer.zero_grad(set_to_none=True)
        with ctx.memory.track_activations():
            step_losses = run_schedule(ctx, chunks, ops, micro, recompute=recompute)
        optimizer.step()
        ctx.memory.sample(f"after step {step}")
        ctx.clock.mark_step()
        if step_losses:
            losses.append(sum(step_losses.values()) / len(step_losses))
        ctx.progress(step + 1, cfg.steps)
    mb = cfg.global_batch // microbatches
    named = {k: t for c in chunks for k, t in reference.full_params(c).items()}
    return rank_result(ctx, losses, stage_params=named,
                       predicted_activations=predicted_activation_bytes(ops, ctx.rank, chunks,
                                                                        mb, recompute),
                       in_flight=microbatches_in_flight(ops[ctx.rank]), schedule=ops,
                       sent_bytes=sum(r.bytes for r in ctx.comm.records if r.op == "send"))


def sweep(ctx, cfg, runs):
    """Several pipeline runs in one launch (starting ranks is the slow part on a laptop).

    runs: list of dicts of `train` keywords, plus optional 'cluster' (for the clock) and
    'steps'. Each run gets a fresh clock, comm log and memory tracker; one result per run."""
    import dataclasses
    from .runtime.clock import Clock
    from .runtime.comm import Comm
    from .runtime.memory import MemoryTracker
    out, launched_on = [], ctx.clock.cluster
    for run in runs:
        run = dict(run)
        ctx.clock = Clock(ctx, run.pop("cluster", launched_on))
        ctx.comm, ctx.memory = Comm(ctx), MemoryTracker(ctx)
        steps = run.pop("steps", cfg.steps)
        out.append(train(ctx, dataclasses.replace(cfg, steps=steps), **run))
    return out


def merge_results(results):
    """The report's view: loss from the last stage, parameters put together from all stages
    (outside the run, so the comm log holds only the pipeline's own traffic)."""
    first = dict(results[0])
    first["loss"] = results[-1]["loss"]
    first["params"] = {k: v for r in results for k, v in r["stage_params"].items()}
    return [first] + list(results[1:])


def add_arguments(parser):
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages P, one per rank (default: the world size)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches M per step")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--virtual", type=int, default=2,
                        help="chunks V per rank for the interleaved schedule")
    parser.add_argument("--recompute", action="store_true",
                        help="keep only stage inputs; recompute the forward in backward")


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", stages=None, microbatches=4,
           schedule="1f1b", virtual=2, recompute=False, split=None, timeout_s=120, **_):
    """Run the pipeline and return the run report (with bubble_fraction, measured)."""
    from .runtime.launch import launch
    from .runs.report import build_report
    cfg = cfg or reference.RunConfig()
    if stages is not None and stages != world_size:
        raise ValueError(f"--stages {stages} but --world-size {world_size}: the pipeline runs "
                         f"one stage per rank, so pass --world-size {stages} (or drop --stages)")
    m = 1 if schedule == "naive" else microbatches
    v = virtual if schedule == "interleaved" else 1
    stage_layout(reference.build_model(cfg), world_size, v, split)  # bad splits fail here
    results = merge_results(launch(train, world_size, cfg, schedule, m, v, recompute, split,
                                   cluster=cluster, timeout_s=timeout_s))
    timeline = [e for r in results for e in r["timeline"]]
    ops = results[0]["schedule"]
    model = reference.build_model(cfg)
    stage0 = build_chunks(model, 0, world_size, v, split)
    n_stage0 = sum(p.numel() for c in stage0 for p in c.parameters())
    states = theory_memory.model_state_bytes(n_stage0, mixed_precision=False,
                                             optimizer=cfg.optimizer)
    predicted = dict(params=states["params"], grads=states["grads"],
                     optimizer=states["optimizer"],
                     activations=results[0]["predicted_activations"])
    predicted["peak"] = sum(predicted.values())
    return build_report(
        "pipeline", cfg, results,
        config=dict(stages=world_size, microbatches=m, schedule=schedule, virtual=v,
                    recompute=recompute),
        predicted_memory=predicted,
        predicted_comm_bytes_per_rank=predicted_send_bytes(ops, 0, stage0,
                                                           cfg.global_batch // m, cfg.steps),
        bubble_fraction=bubble_fraction(timeline, world_size),
        bubble_fraction_theory=theory_time.bubble_fraction(world_size, m, v),
        bubble_fraction_free_links=bubble_fraction(simulate_like(timeline, ops)),
        in_flight_stage0=results[0]["in_flight"],
        schedule_table=format_schedule(ops))


def predicted_send_bytes(schedule, rank, chunks, batch, steps=1):
    """Bytes `rank` sends: each F's output to the next stage, each B's input grad back."""
    p, v_count = len(schedule), len(chunks)
    total = 0
    for kind, m, c in schedule[rank]:
        v = c * p + rank
        if kind == "F" and v < p * v_count - 1:
            total += 4 * math.prod(chunks[c].out_shape(batch))
        elif kind == "B" and v > 0:
            total += 4 * math.prod(chunks[c].in_shape(batch))
    return total * steps


# ========================================================================= the exercise

EXERCISE_CFG = reference.RunConfig(model="mlp", steps=1, global_batch=8, optimizer="sgd",
                                   model_kwargs=dict(dims=(16, 16, 16, 16, 16)))


def parse_ops(ops):
    """'F0' / ('F', 0) / ('F', 0, 0) -> ('F', 0, 0)."""
    out = []
    for op in ops:
        if isinstance(op, str):
            op = (op[0].upper(), int(op[1:]))
        kind, m, *chunk = op
        out.append((str(kind).upper(), int(m), int(chunk[0]) if chunk else 0))
    return out


def check_stage_order(my_ops, stage=0, stages=4, microbatches=8, timeout_s=15):
    """The exercise: `my_ops` is a learner's order of ops for one stage, the other stages run
    labkit's 1F1B. Run it for real on `stages` ranks (a small MLP) and say in plain words what
    happened: malformed, deadlock, wrong result, or right (and whether it is 1F1B). Never raises.
    """
    from .runtime.launch import LaunchError, launch
    p, m = stages, microbatches
    try:
        ops = parse_ops(my_ops)
    except (ValueError, TypeError, IndexError) as error:
        return f"Could not read the ops ({error}): write them like ['F0', 'F1', 'B0', ...]."
    want = sorted(("F", i, 0) for i in range(m)) + sorted(("B", i, 0) for i in range(m))
    missing = sorted(set(want) - set(ops))
    extra = [op for op in ops if ops.count(op) > 1 or op not in want]
    schedule = one_f_one_b_schedule(p, m)
    schedule[stage] = ops
    try:
        simulate_schedule(schedule, 1.0, 2.0)
        predicted = "no deadlock expected"
    except RuntimeError as error:
        predicted = str(error)
    why = []
    if missing:
        why.append("never runs " + ", ".join(f"{k}{i}" for k, i, _ in missing))
    if extra:
        why.append("runs twice or runs unknown ops " + ", ".join(f"{k}{i}" for k, i, _ in extra))
    try:
        results = merge_results(launch(train, p, EXERCISE_CFG, schedule, m, timeout_s=timeout_s,
                                       cluster=comm_free_cluster()))
    except LaunchError as error:
        text = str(error)
        if "timed out" in text:
            where = [line.strip() for line in text.splitlines() if line.strip().startswith("rank")]
            return ("DEADLOCK: the run hung and was stopped after "
                    f"{timeout_s:g} s. Each rank waits for a message that its neighbour only "
                    "sends after it gets one back.\n  " + "\n  ".join(where) +
                    f"\nThe simulator of the same schedule says: {predicted}.")
        last = [line for line in text.splitlines() if line.strip()][-1].strip()
        if why:
            return (f"WRONG SCHEDULE: your stage {stage} " + "; ".join(why) + ". Every "
                    "micro-batch needs one F and one B on every stage; here a neighbour's "
                    f"message was never taken and the run broke off ({last[:90]}...).")
        return f"The run failed on a rank: {last}"
    ref = reference.train(EXERCISE_CFG, track_memory=False)
    diff = reference.max_param_diff(results[0]["params"], ref["params"])
    if why or diff > 1e-5:
        return (f"WRONG RESULT: the parameters differ from the single-device reference by "
                f"{diff:.2e}; your stage {stage} " + ("; ".join(why) or "computes the wrong "
                "gradients") + ". Every micro-batch needs one F and one B on every stage.")
    held, bound = microbatches_in_flight(ops), min(m, p - stage)
    timeline = [e for r in results for e in r["timeline"]]
    verdict = (f"CORRECT: same parameters as the reference (max diff {diff:.1e}); "
               f"bubble {bubble_fraction(timeline):.3f} (modelled; formula "
               f"{theory_time.bubble_fraction(p, m):.3f}, but this MLP's first stage has a "
               f"shorter backward: its input needs no gradient), "
               f"stage {stage} holds at most {held} micro-batches' activations.")
    if held > bound:
        verdict += (f" But that is more than 1F1B's {bound} (P - stage): start the backwards "
                    f"earlier - after {p - stage - 1} warm-up forwards, alternate F and B.")
    elif ops == one_f_one_b_schedule(p, m)[stage]:
        verdict += " That is exactly 1F1B."
    return verdict
