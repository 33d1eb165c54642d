"""Mixture of Experts with expert parallelism: E experts over N ranks, tokens moved by all-to-all.

The idea. An MoE layer replaces the MLP by E expert MLPs and a router that sends each token to
its top-k experts, so a token costs k experts' FLOPs while the model holds E experts' weights.
Expert parallelism puts E/N experts on each of N ranks; every rank routes its own tokens, sends
each (token, choice) to the rank holding that expert (all-to-all), the experts run, and a second
all-to-all brings the outputs home. Backward is the mirror: two more all-to-alls.

The price. Per MoE layer and step each rank hands 4 all-to-alls (2 forward, 2 backward) its
dispatched rows, of which (N-1)/N leave the rank: wire bytes = 4 (N-1)/N * T_rank * k * h * 4 B
(fp32, no drops). Memory per rank: the dense part + E/N experts (and their grads and Adam state).

Same answers as one process. Capacity (slots per expert) and the queue order are decided over
the whole routing group (the EP group's tokens): every rank all-gathers each rank's (k, E)
routing counts, so it knows how many assignments queue ahead of its own and drops exactly the
ones the single-process reference drops (`models.MoELayer`, GShard order: first choices first,
then token index). Non-expert parameters are data-parallel over the world (gradients
all-reduced); with EP < world size each expert has a replica in every EP group and its gradient
is all-reduced over those replicas (the DP group).

What is here: `Layout` / `layout_for`, `AllToAll` (autograd: backward is the reverse
all-to-all), `ExpertParallelMoE`, `train` and `forward_backward` (per rank), `infer`,
`reference_train` (single process), `check_top_k_routing` (the exercise), and `add_arguments` /
`report`: `python -m labkit run moe --world-size N --experts E --top-k K --capacity-factor C`.
"""
import re
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import data, models
from .models import MoEConfig, MoELayer, choice_counts, queue_offsets
from .runs.reference import RunConfig, batch, build_optimizer, full_params
from .runs.report import build_report, rank_result

BYTES_FP32 = 4
EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


# ------------------------------------------------------------------------------------ layout

@dataclass(frozen=True)
class Layout:
    """World = dp x ep ranks; rank = dp_index * ep + ep_index. EP groups are contiguous ranks."""
    ep: int
    dp: int
    ep_group: object       # the ranks that share one routing group and split the experts
    dp_group: object       # the ranks that hold the same experts (None when dp == 1)
    experts: int

    @property
    def per_rank(self):
        return self.experts // self.ep

    def local_experts(self, ep_index=None):
        i = self.ep_group.rank if ep_index is None else ep_index
        return range(i * self.per_rank, (i + 1) * self.per_rank)


def layout_for(ctx, experts, ep=None):
    """Build the EP and DP groups (every rank calls this, in the same order)."""
    world = ctx.world_size
    ep = ep or world
    if world % ep or experts % ep:
        raise ValueError(f"EP degree {ep} must divide the world size ({world}) and the number "
                         f"of experts ({experts})")
    dp = world // ep
    ep_group = ctx.world if dp == 1 else ctx.split_groups(
        [list(range(d * ep, (d + 1) * ep)) for d in range(dp)])
    dp_group = None if dp == 1 else ctx.split_groups(
        [list(range(i, world, ep)) for i in range(ep)])
    return Layout(ep, dp, ep_group, dp_group, experts)


# ------------------------------------------------------------------------------ all-to-all

class AllToAll(torch.autograd.Function):
    """Rows [sum(send[:i]), sum(send[:i+1])) go to group rank i; recv[i] rows come from it.

    Backward sends the gradients back the way the rows came: the same op, splits swapped.
    """

    @staticmethod
    def forward(fctx, rows, ctx, group, send, recv, tag):
        fctx.saved = (ctx, group, send, recv, tag)
        ctx.comm.tag = tag
        out = ctx.comm.all_to_all(rows, input_splits=send, output_splits=recv, group=group)
        ctx.comm.tag = ""
        return out

    @staticmethod
    def backward(fctx, grad):
        ctx, group, send, recv, tag = fctx.saved
        ctx.comm.tag = tag + " (backward)"
        out = ctx.comm.all_to_all(grad.contiguous(), input_splits=recv, output_splits=send,
                                  group=group)
        ctx.comm.tag = ""
        return out, None, None, None, None, None


def kept_counts(counts_by_chunk, capacity):
    """(chunks, E): how many of each chunk's assignments to expert e fit in its capacity."""
    kept = []
    for chunk in range(counts_by_chunk.shape[0]):
        ahead = queue_offsets(counts_by_chunk, chunk)
        kept.append((capacity - ahead).clamp(min=0).minimum(counts_by_chunk[chunk]).sum(dim=0))
    return torch.stack(kept)


# ------------------------------------------------------------------------ the parallel layer

class ExpertParallelMoE(MoELayer):
    """An MoELayer that keeps only this rank's experts and reaches the others by all-to-all."""

    def __init__(self, layer, ctx, layout):
        nn.Module.__init__(self)
        self.moe, self.ctx, self.layout = layer.moe, ctx, layout
        self.router = layer.router
        self.experts = nn.ModuleDict({str(e): layer.experts[str(e)]
                                      for e in layout.local_experts()})
        self.aux_loss = self.z_loss = torch.zeros(())
        self.last, self.sent_rows, self.received_rows = [], 0, 0

    def forward(self, x):
        shape, comm, lay = x.shape, self.ctx.comm, self.layout
        tokens = x.reshape(-1, shape[-1])
        logits, probs, expert, weight = self.gate(tokens)
        # 1. everyone's routing counts -> the same capacity decisions as one process
        comm.tag = "moe counts"
        counts = comm.all_gather(choice_counts(expert, self.moe.experts)[None].contiguous(),
                                 group=lay.ep_group)
        comm.tag = ""
        group_tokens = tokens.shape[0] * lay.ep
        routing = self.assign(logits, probs, expert, weight, counts, lay.ep_group.rank,
                              group_tokens)
        # 2. my kept assignments, ordered by (expert, slot): grouped by destination rank
        tok, choice = routing.kept.nonzero(as_tuple=True)
        dest_expert = routing.expert[tok, choice]
        order = (dest_expert * routing.capacity + routing.position[tok, choice]).argsort()
        tok, choice, dest_expert = tok[order], choice[order], dest_expert[order]
        send = torch.bincount(dest_expert // lay.per_rank, minlength=lay.ep).tolist()
        mine = kept_counts(counts, routing.capacity)[:, list(lay.local_experts())]  # (N, E/N)
        recv = mine.sum(dim=1).tolist()
        # 3. dispatch, run my experts, combine
        rows = AllToAll.apply(tokens[tok], self.ctx, lay.ep_group, send, recv, "moe dispatch")
        row_expert = torch.tensor(list(lay.local_experts())).repeat(lay.ep)
        row_expert = row_expert.repeat_interleave(mine.flatten())
        done = AllToAll.apply(self.run_local_experts(rows, row_expert), self.ctx, lay.ep_group,
                              recv, send, "moe combine")
        out = torch.zeros_like(tokens).index_add(0, tok, done * weight[tok, choice, None])
        # 4. router losses: my share, scaled so the average over ranks is the reference's
        self.aux_loss = routing.aux_loss * lay.ep
        self.z_loss = routing.z_loss
        self.last, self.sent_rows, self.received_rows = [routing], sum(send), sum(recv)
        return out.view(shape)

    def run_local_experts(self, rows, row_expert):
        out = torch.zeros_like(rows)
        for name, expert in self.experts.items():
            idx = (row_expert == int(name)).nonzero().squeeze(1)
            if idx.numel():
                out = out.index_add(0, idx, expert(rows[idx]))
        return out


# ---------------------------------------------------------------------------------- building

def moe_config(cfg, experts=4, top_k=1, capacity_factor=1.25, **kw):
    """An MoEConfig from keyword options (what the CLI passes)."""
    return MoEConfig(experts=experts, top_k=top_k, capacity_factor=capacity_factor, **kw)


def build_model(cfg, moe, groups=1):
    """The full MoEGPT, seeded as the reference builds it (routing groups = DP degree)."""
    if cfg.model != "gpt":
        raise ValueError("moe runs on the tiny GPT: use --model gpt")
    return models.build_moe(seed=cfg.seed, moe=replace(moe, groups=groups), **cfg.model_kwargs)


def expert_parallel_model(ctx, cfg, moe, ep=None):
    """This rank's model: the full model built, then every MoE layer cut to its experts."""
    layout = layout_for(ctx, moe.experts, ep)
    model = build_model(cfg, moe, groups=layout.dp)
    for block in model.blocks:
        block.mlp = ExpertParallelMoE(block.mlp, ctx, layout)
    return model, layout


def is_expert(name):
    return EXPERT_NAME.search(name) is not None


def sync_gradients(ctx, model, layout):
    """Non-expert grads: sum over the world; expert grads: sum over the DP group; both / world.

    One flat buffer per group, with a presence flag per tensor, so an expert that got no token
    on any replica keeps grad None (as in the reference) instead of an Adam step on zeros.
    """
    named = list(model.named_parameters())
    dense = [p for n, p in named if not is_expert(n)]
    expert = [p for n, p in named if is_expert(n)]
    ctx.comm.tag = "dense grads"
    _reduce_grads(ctx, dense, ctx.world, ctx.world_size)
    ctx.comm.tag = "expert grads"
    _reduce_grads(ctx, expert, layout.dp_group, ctx.world_size)
    ctx.comm.tag = ""


def _reduce_grads(ctx, params, group, divide_by):
    if not params or (divide_by == 1):
        return
    parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
             for p in params]
    present = torch.tensor([float(p.grad is not None) for p in params])
    flat = torch.cat(parts + [present])
    if group is not None and group.size > 1:
        ctx.comm.all_reduce(flat, group=group)
    offset, present = 0, flat[-len(params):]
    for p, flag in zip(params, present):
        p.grad = flat[offset:offset + p.numel()].view_as(p) / divide_by if flag > 0 else None
        offset += p.numel()


def gather_params(ctx, model, layout):
    """Full {name: tensor} on rank 0, with the single-process model's names."""
    if layout.ep_group.ranks[0] != 0:     # only the EP group that holds rank 0 gathers
        return None
    named = list(model.named_parameters())
    experts = [(n, p) for n, p in named if is_expert(n)]
    out = {n: p.detach().clone() for n, p in named if not is_expert(n)}
    ctx.comm.tag = "gather params"
    flat = torch.cat([p.detach().reshape(-1) for _, p in experts])
    gathered = ctx.comm.all_gather(flat, group=layout.ep_group).view(layout.ep, -1)
    ctx.comm.tag = ""
    if ctx.rank != 0:
        return None
    shift = layout.per_rank
    for i in range(layout.ep):
        offset = 0
        for n, p in experts:
            e = int(EXPERT_NAME.search(n).group(1)) + i * shift
            out[EXPERT_NAME.sub(f".experts.{e}.", n)] = gathered[i, offset:offset + p.numel()] \
                .view_as(p).clone()
            offset += p.numel()
    return out


def gather_grads(ctx, model, layout):
    """Full gradients on rank 0 (for the equality tests), the same way as gather_params."""
    saved = {n: p.data for n, p in model.named_parameters()}
    for p in model.parameters():
        p.data = p.grad if p.grad is not None else torch.full_like(p, float("nan"))
    grads = gather_params(ctx, model, layout)
    for n, p in model.named_parameters():
        p.data = saved[n]
    return grads


def routing_stats(model):
    """This rank's assignments routed to each expert (before drops), dropped, rows moved."""
    layers = model.moe_layers()
    load = [sum((choice_counts(r.expert, m.moe.experts).sum(0) for r in m.last),
                torch.zeros(m.moe.experts, dtype=torch.long)).tolist() for m in layers]
    return dict(load=load, dropped=sum(r.dropped for m in layers for r in m.last),
                sent=[getattr(m, "sent_rows", 0) for m in layers],
                received=[getattr(m, "received_rows", 0) for m in layers])


# ---------------------------------------------------------------------------------- training

def train(ctx, cfg=None, moe=MoEConfig(), ep=None):
    """Expert-parallel training on this rank; rank_result with per-step routing stats."""
    cfg = cfg or RunConfig()
    model, layout = expert_parallel_model(ctx, cfg, moe, ep)
    optimizer = build_optimizer(model.parameters(), cfg)
    ctx.memory.watch(model=model, optimizer=optimizer)
    losses, stats = [], []
    for step in range(cfg.steps):
        x, y = (data.shard(t, ctx.rank, ctx.world_size) for t in batch(model, cfg, step))
        optimizer.zero_grad(set_to_none=True)
        with ctx.memory.track_activations(), ctx.clock.compute("forward+backward"):
            loss = model(x, y)
            loss.backward()
        sync_gradients(ctx, model, layout)
        with ctx.clock.compute("optimizer step"):
            optimizer.step()
        ctx.memory.sample(f"after step {step}")
        ctx.clock.mark_step()
        ctx.progress(step + 1, cfg.steps)
        losses.append(loss.item())
        stats.append(routing_stats(model))
    return rank_result(ctx, losses, params=gather_params(ctx, model, layout), routing=stats,
                       ep=layout.ep, dp=layout.dp)


def forward_backward(ctx, cfg=None, moe=MoEConfig(), ep=None, step=0):
    """One forward and backward on step `step`'s batch: local logits, loss, full grads (rank 0)."""
    cfg = cfg or RunConfig()
    model, layout = expert_parallel_model(ctx, cfg, moe, ep)
    x, y = (data.shard(t, ctx.rank, ctx.world_size) for t in batch(model, cfg, step))
    loss = model(x, y)
    loss.backward()
    sync_gradients(ctx, model, layout)
    with torch.no_grad():
        logits = model(x)   # same weights, same routing: the outputs
    return dict(rank=ctx.rank, loss=loss.item(), logits=logits, grads=gather_grads(ctx, model,
                layout), routing=routing_stats(model))


def infer(ctx, cfg=None, moe=MoEConfig(), ep=None, batches=()):
    """Inference with experts spread over ranks: each rank runs its shard of every batch."""
    cfg = cfg or RunConfig()
    model, _ = expert_parallel_model(ctx, cfg, moe, ep)
    model.eval()
    outputs, times = [], []
    for i, tokens in enumerate(batches):
        start = ctx.clock.now()
        with torch.no_grad(), ctx.clock.compute(f"batch {i}"):
            outputs.append(model(data.shard(tokens, ctx.rank, ctx.world_size)))
        times.append(ctx.clock.now() - start)
    return dict(rank=ctx.rank, outputs=outputs, batch_s=times, routing=routing_stats(model),
                comm=ctx.comm.summary(), timeline=ctx.clock.timeline())


def reference_train(cfg=None, moe=MoEConfig(), groups=1):
    """The single-process MoE run every EP layout must reproduce (routing groups = DP degree)."""
    cfg = cfg or RunConfig()
    model = build_model(cfg, moe, groups)
    optimizer = build_optimizer(model.parameters(), cfg)
    losses, stats = [], []
    for step in range(cfg.steps):
        x, y = batch(model, cfg, step)
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        stats.append(routing_stats(model))
    return dict(loss=losses, params=full_params(model), routing=stats, model=model)


def reference_forward_backward(cfg=None, moe=MoEConfig(), groups=1, step=0):
    """The single-process counterpart of `forward_backward`."""
    cfg = cfg or RunConfig()
    model = build_model(cfg, moe, groups)
    x, y = batch(model, cfg, step)
    loss = model(x, y)
    loss.backward()
    with torch.no_grad():
        logits = model(x)
    grads = {n: p.grad.clone() if p.grad is not None else torch.full_like(p, float("nan"))
             for n, p in model.named_parameters()}
    return dict(loss=loss.item(), logits=logits, grads=grads, routing=routing_stats(model))


def load_imbalance(load):
    """max load / mean load over experts: 1.0 is perfectly balanced."""
    load = torch.as_tensor(load, dtype=torch.float64)
    return (load.max() / load.mean()).item()


def load_over_steps(routing, steps, layer=0):
    """Per-expert assignments summed over `steps` (a range) of a run's routing stats."""
    return [sum(routing[s]["load"][layer][e] for s in steps)
            for e in range(len(routing[0]["load"][layer]))]


# ------------------------------------------------------------------------------ the exercise

@dataclass
class RoutingCheck:
    ok: bool
    problem: str
    message: str

    def __repr__(self):
        return self.message


def reference_top_k_routing(logits, k, capacity):
    """The answer key: (expert (T, k), weight (T, k), kept (T, k)) as labkit routes."""
    _, expert, weight = models.top_k_gates(logits, k)
    counts = choice_counts(expert, logits.shape[-1])[None]
    position = models.queue_positions(expert, logits.shape[-1], queue_offsets(counts, 0))
    return expert, weight, position < capacity


def check_top_k_routing(fn, verbose=True):
    """Check a learner's `fn(logits, k, capacity) -> (expert, weight, kept)`; say what is wrong.

    Conventions (models.MoEConfig): softmax over experts; top-1 weight = the probability, top-2
    weights renormalised to sum to 1; each expert takes at most `capacity` assignments, first
    choices before second choices, earlier tokens first; the rest are dropped (kept = False).
    """
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(16, 4, generator=g), 1, 3), (torch.randn(16, 4, generator=g), 2, 6),
             (torch.randn(24, 4, generator=g) + torch.tensor([2.0, 0, 0, 0]), 1, 4),
             (torch.randn(24, 8, generator=g), 2, 5)]
    for logits, k, capacity in cases:
        want_e, want_w, want_k = reference_top_k_routing(logits, k, capacity)
        where = f"(T={logits.shape[0]} tokens, E={logits.shape[1]} experts, k={k}, " \
                f"capacity={capacity})"
        try:
            got = fn(logits.clone(), k, capacity)
            got_e, got_w, got_k = (torch.as_tensor(t) for t in got)
        except Exception as error:   # the learner's code raised: say so, do not raise
            return _say(RoutingCheck(False, "error", f"Your function raised {error!r} {where}."),
                        verbose)
        if tuple(got_e.shape) != tuple(want_e.shape):
            return _say(RoutingCheck(False, "shape", (
                f"expert has shape {tuple(got_e.shape)}, expected {tuple(want_e.shape)} "
                f"(tokens, k) {where}.")), verbose)
        if not torch.equal(got_e.sort(-1).values, want_e.sort(-1).values):
            return _say(RoutingCheck(False, "experts", (
                f"Wrong experts chosen {where}: each token must go to its k experts with the "
                "largest router probability (softmax of the logits, then topk).")), verbose)
        if not torch.equal(got_e, want_e):
            return _say(RoutingCheck(False, "choice order", (
                f"Right experts, wrong order {where}: column 0 must hold each token's first "
                "choice (highest probability), column 1 its second.")), verbose)
        if not torch.allclose(got_w.float(), want_w, atol=1e-5):
            sums = got_w.float().sum(-1)
            hint = ("for k=2 divide the two probabilities by their sum" if k == 2 and
                    not torch.allclose(sums, torch.ones_like(sums), atol=1e-4) else
                    "for k=1 use the softmax probability itself" if k == 1 else
                    "use the softmax probabilities of the chosen experts")
            return _say(RoutingCheck(False, "weights", f"Wrong gate weights {where}: {hint}."),
                        verbose)
        got_k = got_k.bool()
        load = torch.bincount(got_e[got_k], minlength=logits.shape[1])
        if (load > capacity).any():
            return _say(RoutingCheck(False, "capacity", (
                f"Expert(s) {(load > capacity).nonzero().flatten().tolist()} keep "
                f"{load.max().item()} assignments but the capacity is {capacity} {where}: drop "
                "the assignments past the capacity.")), verbose)
        if got_k.sum() < want_k.sum():
            return _say(RoutingCheck(False, "over-dropping", (
                f"You keep {int(got_k.sum())} assignments, {int(want_k.sum())} fit {where}: an "
                "expert should fill all its capacity slots before dropping.")), verbose)
        if not torch.equal(got_k, want_k):
            return _say(RoutingCheck(False, "drop order", (
                f"The right number of assignments is kept, but not the right ones {where}: "
                "fill each expert's slots with all first choices (in token order) before any "
                "second choice, and drop the latest tokens.")), verbose)
    return _say(RoutingCheck(True, "", "Correct: top-k routing with capacity and drops matches "
                                       "labkit on all cases."), verbose)


def _say(check, verbose):
    if verbose:
        print(check.message)
    return check


# ------------------------------------------------------------------------- CLI and report

def add_arguments(parser):
    """Options of `python -m labkit run moe`."""
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE layer")
    parser.add_argument("--top-k", type=int, default=1, choices=(1, 2))
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel degree (divides world size; default: world size)")
    parser.add_argument("--aux-loss-coef", type=float, default=0.01)
    parser.add_argument("--z-loss-coef", type=float, default=1e-3)


def predicted_memory(cfg, moe, ep):
    """fp32 Adam states per rank: (4 + 4 + 8) bytes x (dense params + E/ep experts' params)."""
    model = build_model(cfg, moe)
    named = list(model.named_parameters())
    dense = sum(p.numel() for n, p in named if not is_expert(n))
    experts = sum(p.numel() for n, p in named if is_expert(n))
    local = dense + experts // ep
    extra = 4 if cfg.optimizer == "sgd" else 8
    out = dict(params=4 * local, grads=4 * local, optimizer=(extra - 4 if cfg.optimizer == "sgd"
                                                              else extra) * local)
    out["model_states"] = sum(out.values())
    return out


def comm_prediction(result, cfg, moe, ep, dp, world, hidden):
    """Wire bytes per rank by op, from this rank's routing and theory.time's per-op formulas:
    all_to_all 4 per layer-step on the rows it sent and received; all_reduce once per step
    (dense grads over the world, expert grads over the DP group, one presence flag per tensor);
    all_gather of the (k, E) int64 routing counts per layer-step, and the final expert gather."""
    from .theory import moe as tmoe
    from .theory import time as tt
    rows = sum(sum(s["sent"]) + sum(s["received"]) for s in result["routing"])
    named = list(build_model(cfg, moe).named_parameters())
    dense = [p.numel() for n, p in named if not is_expert(n)]
    expert = [p.numel() for n, p in named if is_expert(n)]
    local_expert, local_tensors = sum(expert) // ep, len(expert) // ep
    reduce = cfg.steps * (tt.wire_bytes_per_rank("all_reduce", 4 * (sum(dense) + len(dense)),
                                                 world)
                          + tt.wire_bytes_per_rank("all_reduce",
                                                   4 * (local_expert + local_tensors), dp))
    layers = len(result["routing"][0]["sent"])
    gather = (cfg.steps * layers * tt.wire_bytes_per_rank("all_gather",
                                                          8 * moe.top_k * moe.experts, ep)
              + tt.wire_bytes_per_rank("all_gather", 4 * local_expert, ep))
    return dict(all_to_all=tmoe.all_to_all_wire_bytes_from_rows(rows, hidden, ep),
                all_reduce=reduce, all_gather=gather)


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", experts=4, top_k=1,
           capacity_factor=1.25, ep=None, aux_loss_coef=0.01, z_loss_coef=1e-3, **_):
    """Run expert-parallel training and return the run report, checked against the
    single-process MoE reference (same routing groups, same capacity, same drops)."""
    from .runtime.launch import launch
    cfg = cfg or RunConfig()
    moe = MoEConfig(experts=experts, top_k=top_k, capacity_factor=capacity_factor,
                    aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef)
    ep = ep or world_size
    results = launch(train, world_size, cfg, moe=moe, ep=ep, cluster=cluster)
    dp = world_size // ep
    ref = reference_train(cfg, moe, groups=dp)
    loss = [sum(r["loss"][s] for r in results) / world_size for s in range(cfg.steps)]
    dropped = [sum(r["routing"][s]["dropped"] for r in results) for s in range(cfg.steps)]
    load = [[sum(r["routing"][-1]["load"][layer][e] for r in results) for e in range(experts)]
            for layer in range(len(results[0]["routing"][-1]["load"]))]
    hidden = build_model(cfg, moe).cfg.hidden
    tokens = cfg.global_batch * build_model(cfg, moe).cfg.seq
    by_op = comm_prediction(results[0], cfg, moe, ep, dp, world_size, hidden)
    results[0] = dict(results[0], loss=loss)
    return build_report(
        "moe", cfg, results, reference=ref,
        config=dict(moe.as_dict(), ep=ep, dp=dp, capacity=moe.capacity(tokens // dp)),
        predicted_memory=predicted_memory(cfg, moe, ep),
        predicted_comm_bytes_per_rank=sum(by_op.values()), predicted_comm_by_op=by_op,
        tokens_dropped=dropped, reference_tokens_dropped=[s["dropped"] for s in ref["routing"]],
        assignments_per_step=tokens * top_k * len(load), expert_load=load,
        load_imbalance=[load_imbalance(layer) for layer in load])
