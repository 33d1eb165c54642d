"""Mixture of Experts with expert parallelism (lesson 05): labkit's MoE GPT on N ranks.

Every block's MoE layer is wrapped in `ExpertParallel` over an EP group of `ep` ranks (default:
all of them), which holds E/ep experts per rank and moves tokens by all-to-all; the rest of the
model (embeddings, attention, norms, routers) is data-parallel over the world, its gradients
averaged here with one all_reduce. With ep < world size the world is dp = world/ep EP groups of
neighbouring ranks; each expert then has dp replicas whose gradients are averaged too. The
single-process reference routes each EP group's tokens as one routing group (MoEConfig.groups
= dp), so capacity, drops, losses and parameters must match it.

    python -m labkit run moe --world-size 2 --experts 4 --top-k 2 --capacity-factor 1.25 --json

What is here: `train` (per rank), `infer`, `reference_train` (one process), the report, and
the helpers the lesson reads (`load_imbalance`, `load_over_steps`).
"""
import re
from dataclasses import replace

import torch

from .. import data, models
from ..models import MoEConfig
from ..parallel.flat import average_gradients
from ..parallel.moe import ExpertParallel, check_expert_parallel, full_parameters
from .reference import RunConfig, batch, build_optimizer, full_params
from .report import build_report, rank_result

EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


def is_expert(name):
    return EXPERT_NAME.search(name) is not None


def check_config(world_size, cfg, moe, ep):
    """Everything that can be checked before ranks start, in one line each."""
    if cfg.model != "gpt":
        raise ValueError("moe runs on the tiny GPT: use --model gpt")
    if world_size < 1 or cfg.steps < 1 or cfg.global_batch < 1:
        raise ValueError("world size, steps and batch must be positive integers")
    if ep < 1 or world_size % ep:
        raise ValueError(f"the EP degree ({ep}) must divide the world size ({world_size})")
    check_expert_parallel(moe.experts, moe.top_k, moe.capacity_factor, ep)
    if cfg.global_batch % world_size:
        raise ValueError(f"the batch ({cfg.global_batch} sequences) must divide by the world "
                         f"size ({world_size})")


# ---------------------------------------------------------------------------------- building

def build_model(cfg, moe, groups=1):
    """The full MoEGPT, seeded as the reference builds it (routing groups = DP degree)."""
    if cfg.model != "gpt":
        raise ValueError("moe runs on the tiny GPT: use --model gpt")
    return models.build_moe(seed=cfg.seed, moe=replace(moe, groups=groups), **cfg.model_kwargs)


def expert_groups(ctx, ep):
    """(EP group, expert-replica group or None): EP groups are neighbouring ranks, as the
    `ep` of `ctx.mesh(dp=world, ep=ep)` lays them out. Every rank calls this, same order."""
    world = ctx.world_size
    if ep == world:
        return ctx.world, None
    ep_group = ctx.split_groups([list(range(d * ep, (d + 1) * ep)) for d in range(world // ep)])
    replicas = ctx.split_groups([list(range(i, world, ep)) for i in range(ep)])
    return ep_group, replicas


def expert_parallel_model(ctx, cfg, moe, ep=None):
    """This rank's model: the full model built, then every MoE layer wrapped in ExpertParallel
    (which keeps this rank's experts). Returns (model, replica group of the experts or None)."""
    ep = ep or ctx.world_size
    ep_group, replicas = expert_groups(ctx, ep)
    model = build_model(cfg, moe, groups=ctx.world_size // ep)
    for block in model.blocks:
        block.mlp = ExpertParallel(block.mlp, group=ep_group, tag="moe")
    return model, replicas


def average_moe_gradients(model, replicas):
    """Dense gradients averaged over the world; expert gradients (already the EP group's mean,
    see ExpertParallel) averaged over their replicas. An expert that got no token on any
    replica keeps grad None, as in the reference, instead of an Adam step on zeros."""
    named = list(model.named_parameters())
    average_gradients([p for n, p in named if not is_expert(n)], None, skip_unused=True,
                      tag="dense grads")
    if replicas is not None:
        average_gradients([p for n, p in named if is_expert(n)], replicas, skip_unused=True,
                          tag="expert grads")


def routing_stats(model):
    """Per layer: this rank's assignments routed to each expert (before drops), its dropped
    assignments and the rows it sent and received (for the reference: the whole batch)."""
    layers = model.moe_layers()
    if layers and isinstance(layers[0], ExpertParallel):
        routes = [m.routing for m in layers]
        return dict(load=[r["load"].tolist() for r in routes],
                    dropped=sum(r["dropped"] for r in routes),
                    sent=[r["sent"] for r in routes], received=[r["received"] for r in routes])
    load = [sum(((r.expert[:, :, None] == torch.arange(m.moe.experts)).sum((0, 1))
                 for r in m.last), torch.zeros(m.moe.experts, dtype=torch.long)).tolist()
            for m in layers]
    return dict(load=load, dropped=sum(r.dropped for m in layers for r in m.last),
                sent=[0] * len(layers), received=[0] * len(layers))


# ---------------------------------------------------------------------------------- training

def train(ctx, cfg=None, moe=MoEConfig(), ep=None):
    """Expert-parallel training on this rank; rank_result with per-step routing stats."""
    cfg = cfg or RunConfig()
    model, replicas = expert_parallel_model(ctx, cfg, moe, ep)
    optimizer = build_optimizer(model.parameters(), cfg)
    ctx.memory.watch(model=model, optimizer=optimizer)
    losses, stats = [], []
    for step in range(cfg.steps):
        with ctx.step(step, cfg.steps):
            x, y = (data.shard(t, ctx.rank, ctx.world_size) for t in batch(model, cfg, step))
            optimizer.zero_grad(set_to_none=True)
            with ctx.memory.track_activations(), ctx.clock.compute("forward+backward"):
                loss = model(x, y)
                loss.backward()
            average_moe_gradients(model, replicas)
            with ctx.clock.compute("optimizer step"):
                optimizer.step()
        losses.append(loss.item())
        stats.append(routing_stats(model))
    params = full_parameters(model)
    return rank_result(ctx, losses, params=params if ctx.rank == 0 else None, routing=stats,
                       ep=ep or ctx.world_size)


def infer(ctx, cfg=None, moe=MoEConfig(), ep=None, batches=()):
    """Inference with the experts spread over ranks: each rank runs its shard of every batch
    (token ids) and returns its logits, modelled seconds per batch and routing stats."""
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


def reference_train(cfg=None, moe=MoEConfig(), groups=1, dtype=torch.float32):
    """The single-process MoE run every EP layout must reproduce (routing groups = DP degree);
    `dtype=torch.float64`: the exact run that rounding is measured from (labkit.numerics)."""
    cfg = cfg or RunConfig()
    model = build_model(cfg, moe, groups).to(dtype)
    optimizer = build_optimizer(model.parameters(), cfg)
    losses, stats = [], []
    for step in range(cfg.steps):
        x, y = batch(model, cfg, step, dtype)
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        stats.append(routing_stats(model))
    return dict(loss=losses, params=full_params(model), routing=stats, model=model)


def load_imbalance(load):
    """max load / mean load over experts: 1.0 is perfectly balanced."""
    load = torch.as_tensor(load, dtype=torch.float64)
    return (load.max() / load.mean()).item()


def load_over_steps(routing, steps, layer=0):
    """Per-expert assignments summed over `steps` (a range) of a run's routing stats."""
    return [sum(routing[s]["load"][layer][e] for s in steps)
            for e in range(len(routing[0]["load"][layer]))]


# ------------------------------------------------------------------------- CLI and report

def add_arguments(parser):
    """Options of `python -m labkit run moe`."""
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE layer")
    parser.add_argument("--top-k", type=int, default=1, help="experts per token")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel degree (divides world size; default: world size)")
    parser.add_argument("--aux-loss-coef", type=float, default=0.01)
    parser.add_argument("--z-loss-coef", type=float, default=1e-3)


def _param_counts(cfg, moe):
    named = list(build_model(cfg, moe).named_parameters())
    dense = [p.numel() for n, p in named if not is_expert(n)]
    experts = [p.numel() for n, p in named if is_expert(n)]
    return dense, experts


def predicted_memory(cfg, moe, ep):
    """fp32 states per rank: 4 B weights + 4 B grads (+ 8 B Adam moments) for the dense
    params + E/ep experts' params."""
    dense, experts = _param_counts(cfg, moe)
    local = sum(dense) + sum(experts) // ep
    out = dict(params=4 * local, grads=4 * local,
               optimizer=0 if cfg.optimizer == "sgd" else 8 * local)
    out["model_states"] = sum(out.values())
    return out


def comm_prediction(result, cfg, moe, ep, world):
    """Ring-model bytes per rank by op (modelled), from this rank's routing and theory/'s per-op
    formulas: all_to_all 4 per layer-step on the rows it sent and received; all_reduce once per
    step (dense grads over the world, expert grads over their replicas, a presence flag per
    tensor); all_gather of the k E + 1 routing counts per layer-step, and of each layer's local
    experts once at the end (the report's parameters)."""
    from ..theory import moe as tmoe
    from ..theory import time as tt
    dense, experts = _param_counts(cfg, moe)
    layers = len(result["routing"][0]["sent"])
    local_expert, local_tensors = sum(experts) // ep, len(experts) // ep
    reduce = cfg.steps * tt.wire_bytes_per_rank("all_reduce", 4 * (sum(dense) + len(dense)),
                                                world)
    if world > ep:
        reduce += cfg.steps * tt.wire_bytes_per_rank(
            "all_reduce", 4 * (local_expert + local_tensors), world // ep)
    gather = (cfg.steps * layers * tt.wire_bytes_per_rank(
        "all_gather", 8 * (moe.top_k * moe.experts + 1), ep)
        + layers * tt.wire_bytes_per_rank("all_gather", 4 * local_expert // layers, ep))
    rows = sum(sum(s["sent"]) + sum(s["received"]) for s in result["routing"])
    hidden = build_model(cfg, moe).cfg.hidden
    return dict(all_to_all=tmoe.all_to_all_wire_bytes_from_rows(rows, hidden, ep),
                all_reduce=reduce, all_gather=gather)


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", experts=4, top_k=1,
           capacity_factor=1.25, ep=None, aux_loss_coef=0.01, z_loss_coef=1e-3, **_):
    """Run expert-parallel training and return the run report, checked against the
    single-process MoE reference (same routing groups, same capacity, same drops)."""
    from ..runtime.launch import launch
    cfg = cfg or RunConfig()
    moe = MoEConfig(experts=experts, top_k=top_k, capacity_factor=capacity_factor,
                    aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef)
    ep = ep or world_size
    check_config(world_size, cfg, moe, ep)
    results = launch(train, world_size, cfg, moe=moe, ep=ep, cluster=cluster)
    dp = world_size // ep
    ref = reference_train(cfg, moe, groups=dp)
    loss = [sum(r["loss"][s] for r in results) / world_size for s in range(cfg.steps)]
    dropped = [sum(r["routing"][s]["dropped"] for r in results) for s in range(cfg.steps)]
    layers = len(results[0]["routing"][-1]["load"])
    load = [[sum(r["routing"][-1]["load"][layer][e] for r in results) for e in range(experts)]
            for layer in range(layers)]
    shape = build_model(cfg, moe).cfg
    tokens = cfg.global_batch * shape.seq
    by_op = comm_prediction(results[0], cfg, moe, ep, world_size)
    results[0] = dict(results[0], loss=loss)
    return build_report(
        "moe", cfg, results, reference=ref,
        exact=reference_train(cfg, moe, groups=dp, dtype=torch.float64),
        config=dict(moe.as_dict(), ep=ep, dp=dp, capacity=moe.capacity(tokens // dp)),
        predicted_memory=predicted_memory(cfg, moe, ep),
        predicted_comm_bytes_per_rank=sum(by_op.values()), predicted_comm_by_op=by_op,
        tokens_dropped=dropped, reference_tokens_dropped=[s["dropped"] for s in ref["routing"]],
        assignments_per_step=tokens * top_k * layers, expert_load=load,
        load_imbalance=[load_imbalance(layer) for layer in load])
