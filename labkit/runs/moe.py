"""Mixture of Experts with expert parallelism (lesson 05): labkit's MoE GPT on N ranks.

Every block's MoE layer is wrapped in `ExpertParallel` over an EP group of `ep` ranks (default:
all of them), which holds E/ep experts per rank and moves tokens by all-to-all; the rest of the
model (embeddings, attention, norms, routers) is data-parallel over the world, its gradients
averaged here with one all_reduce. With ep < world size the world is dp = world/ep EP groups of
neighbouring ranks; each expert then has dp replicas whose gradients are averaged too. The
single-process reference routes each EP group's tokens as one routing group (MoEConfig.groups
= dp), so capacity, drops, losses and parameters must match it.

    python -m labkit run moe --world-size 2 --experts 4 --top-k 2 --capacity-factor 1.25 --json

What is here: `train` (per rank), `infer`, `reference_train` (one process) and the report.
The mechanics (expert groups, gradient averaging, routing stats) are
labkit.parallel.moe's; the predictions and load measures labkit.theory.moe's.
"""
from dataclasses import replace

import torch

from .. import data, models
from ..models import MoEConfig
from ..parallel.moe import (ExpertParallel, average_moe_gradients, check_expert_parallel,
                            expert_groups, full_parameters, merge_routing, parameter_counts,
                            routing_stats)
from ..theory import moe as theory_moe
from . import reference
from .reference import RunConfig, batch, build_optimizer
from .report import build_report, launch_checked
from .trainer import Trainer, batch_shard


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


def expert_parallel_model(ctx, cfg, moe, ep=None):
    """This rank's model: the full model built, then every MoE layer wrapped in ExpertParallel
    (which keeps this rank's experts). Returns (model, replica group of the experts or None)."""
    ep = ep or ctx.world_size
    ep_group, replicas = expert_groups(ep)
    model = build_model(cfg, moe, groups=ctx.world_size // ep)
    for block in model.blocks:
        block.mlp = ExpertParallel(block.mlp, group=ep_group, tag="moe")
    return model, replicas


# ---------------------------------------------------------------------------------- training

def train(ctx, cfg=None, moe=MoEConfig(), ep=None):
    """Expert-parallel training on this rank; rank_result with per-step routing stats."""
    cfg = cfg or RunConfig()
    model, replicas = expert_parallel_model(ctx, cfg, moe, ep)
    stats = []
    trainer = Trainer(
        ctx, cfg, model, optimizer=build_optimizer, batch=batch, fused=True,
        shard=batch_shard(ctx),
        # the dense weights over the world, each expert over its replicas
        after_backward=lambda: average_moe_gradients(model, replicas),
        after_step=lambda step: stats.append(routing_stats(model))).fit()
    params = full_parameters(model)
    return trainer.result(params if ctx.rank == 0 else None, routing=stats,
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
    model = build_model(cfg, moe, groups)
    run = reference.train(cfg, track_memory=False, dtype=dtype, model=model,
                          step_stats=routing_stats)
    return dict(loss=run["loss"], params=run["params"], routing=run["step_stats"], model=model)


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


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", experts=4, top_k=1,
           capacity_factor=1.25, ep=None, aux_loss_coef=0.01, z_loss_coef=1e-3, **_):
    """Run expert-parallel training and return the run report, checked against the
    single-process MoE reference (same routing groups, same capacity, same drops)."""
    cfg = cfg or RunConfig()
    moe = MoEConfig(experts=experts, top_k=top_k, capacity_factor=capacity_factor,
                    aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef)
    ep = ep or world_size
    results = launch_checked(
        "moe", train, world_size, cfg, dict(moe=moe, ep=ep),
        check=lambda: check_config(world_size, cfg, moe, ep), cluster=cluster,
        cli_options=dict(experts=experts, top_k=top_k, capacity_factor=capacity_factor, ep=ep))
    dp = world_size // ep
    ref = reference_train(cfg, moe, groups=dp)
    loss = [sum(r["loss"][s] for r in results) / world_size for s in range(cfg.steps)]
    dropped, load = merge_routing([r["routing"] for r in results])
    shape, layers = ref["model"].cfg, len(load)
    dense_params, dense_tensors, expert_params, expert_tensors = parameter_counts(ref["model"])
    tokens = cfg.global_batch * shape.seq
    by_op = theory_moe.expert_parallel_run_comm(
        steps=cfg.steps, layers=layers, dense_params=dense_params, dense_tensors=dense_tensors,
        expert_params=expert_params, expert_tensors=expert_tensors, experts=experts,
        top_k=top_k, hidden=shape.hidden, ep=ep, world=world_size,
        rows=sum(sum(s["sent"]) + sum(s["received"]) for s in results[0]["routing"]))
    results[0] = dict(results[0], loss=loss)
    return build_report(
        "moe", cfg, results, reference=ref,
        exact=reference_train(cfg, moe, groups=dp, dtype=torch.float64),
        config=dict(moe.as_dict(), ep=ep, dp=dp, capacity=moe.capacity(tokens // dp)),
        predicted_memory=theory_moe.expert_parallel_state_bytes(dense_params, expert_params,
                                                                ep, cfg.optimizer),
        predicted_comm_bytes_per_rank=sum(by_op.values()), predicted_comm_by_op=by_op,
        tokens_dropped=dropped, reference_tokens_dropped=[s["dropped"] for s in ref["routing"]],
        assignments_per_step=tokens * top_k * layers, expert_load=load,
        load_imbalance=[theory_moe.load_imbalance(layer) for layer in load])
