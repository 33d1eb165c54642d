"""DP x TP x PP x CP (x EP) on labkit's GPT: the blocks composed on a mesh, checked against one
device.

`python -m labkit run hybrid --dp 2 --tp 2 --pp 2 [--cp 2 [--cp-layout zigzag|contiguous]]
[--zero 1|2|3 [--dp-replicate R]] [--schedule 1f1b] [--sequence-parallel] [--experts 4 --ep 2]
[--order tp,pp,dp,cp] --json` trains the tiny GPT
(or its MoE variant) on dp x tp x pp x cp CPU ranks with `labkit.parallel.hybrid.HybridParallel`
and returns the run report (docs/architecture.md, Contracts): loss and parameters against
the single-device run, memory per rank, the comm log split by the mesh's groups (dp / tp / pp
/ ep; under --zero 3 dp_shard / dp_replicate), the modelled step. `--zero 3` is FSDP (HSDP
with --dp-replicate): the report adds `predicted_comm_by_dim` (theory/hybrid.fsdp_wire_bytes
for each rank's stage).
With --cp each rank trains on its shard of every sequence (the embedding given the shard's
global positions); the gradients are averaged over dp x cp (`dp_cp`; under --zero 3 FullyShard
shards over dp_shard x cp) and the report adds `predicted_cp_wire_bytes`
(theory/hybrid.cp_wire_bytes: the ring's bytes, summed over the ranks, over the run).
With --experts and --cp each rank routes its sequence shard through the ep all-to-all; the
experts' gradients are averaged over their dp x cp / ep replicas (`ep_dp`). With --experts and
--zero 3 FullyShard shards the experts over those replicas (within one dp_shard group under
HSDP): their gathers and reduce-scatters are the `ep_dp` rows.
The MoE variant routes without capacity limits (capacity factor = experts / top_k: nothing is
dropped, so micro-batching cannot change the routing) and without router losses, so the one
device reference trains the same function.
"""
from dataclasses import replace

import torch.nn as nn

from .. import data, models
from ..parallel.context_parallelism import LAYOUTS, sequence_positions, shard_sequence
from ..parallel.hybrid import HybridParallel, check_recompute
from ..parallel.mesh_dims import SCHEDULES, check_layout
from ..runtime.mesh import DIMS, comm_by_dim
from ..theory import hybrid as theory_hybrid
from ..theory import pipeline as schedules
from . import reference
from ..parallel.tensor_parallel_plan import gpt_plan
from ..parallel.zero import ShardedOptimizer
from ..runtime.memory import optimizer_state_tensors
from .report import build_report, launch_checked, mean_loss
from .trainer import Optimizers, Trainer


def moe_config(experts, top_k):
    """An MoE that drops nothing and adds no router loss (see the module docstring)."""
    return models.MoEConfig(experts=experts, top_k=top_k, capacity_factor=experts / top_k,
                            aux_loss_coef=0.0, z_loss_coef=0.0)


def run_config(cfg, experts=0, top_k=1):
    """`cfg` as the hybrid trains it: the MoE GPT when experts > 0."""
    if not experts:
        return cfg
    kwargs = dict(cfg.model_kwargs, moe=moe_config(experts, top_k))
    return replace(cfg, model="moe", model_kwargs=kwargs)


def check_config(cfg, dp, tp, pp, ep=1, zero=0, schedule="1f1b", microbatches=4, virtual=1,
                 sequence_parallel=False, experts=0, top_k=1, dp_replicate=1, cp=1,
                 cp_layout="zigzag"):
    """One-line ValueError for a layout this model or batch cannot take (before any rank)."""
    if cfg.model != "gpt":
        raise ValueError("the hybrid trains the tiny GPT (--model gpt; --experts N for MoE)")
    if experts:
        models.MoEConfig(experts=experts, top_k=top_k)      # its own one-line checks
    c = models.GPTConfig(**cfg.model_kwargs)
    check_layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, schedule=schedule,
                 microbatches=microbatches, virtual=virtual,
                 sequence_parallel=sequence_parallel, experts=experts, layers=c.layers,
                 heads=c.heads, ffn=c.ffn, vocab=c.vocab, seq=c.seq,
                 global_batch=cfg.global_batch, dp_replicate=dp_replicate, cp=cp,
                 cp_layout=cp_layout)


class ShardEmbeddings(nn.Module):
    """The GPT's token + position embedding of a context-parallel rank: its tokens are a
    shard of each sequence, so their positions are the shard's global ones, not 0..s/cp-1
    (the same `tok` and `pos` modules: the parameters keep their names)."""

    def __init__(self, embeddings, positions):
        super().__init__()
        self.tok, self.pos = embeddings.tok, embeddings.pos
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, idx):
        return self.tok(idx) + self.pos(self.positions)


def train(ctx, cfg, dp, tp, pp, ep=1, zero=0, schedule="1f1b", microbatches=4, virtual=1,
          sequence_parallel=False, order=DIMS, dp_replicate=1, cp=1, cp_layout="zigzag",
          recompute=False, recompute_layers=None):
    """Train on this rank's place in the mesh; returns `rank_result` with its stages' params.
    cp > 1: the rank's batch rows (by dp) and its shard of each sequence (by cp, inputs and
    the already-shifted targets alike), the embedding given the shard's global positions."""
    mesh = ctx.mesh(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, order=tuple(order))
    model = reference.build_model(cfg)
    layers = model.as_sequential()
    if cp > 1:
        layers[0] = ShardEmbeddings(layers[0], sequence_positions(
            model.cfg.seq, mesh.coords["cp"], cp, cp_layout))
    by_identity = {id(p): name for name, p in model.named_parameters()}
    model_name = {name: by_identity[id(p)] for name, p in layers.named_parameters()}
    hybrid = HybridParallel(
        layers, mesh, reference.token_loss, tp_plan=gpt_plan(sequence_parallel, sequential=True),
        sequence_parallel=sequence_parallel, schedule=schedule, n_microbatches=microbatches,
        virtual=virtual if schedule == "interleaved" else 1,
        expert_parallel=cfg.model == "moe", zero_stage=zero, dp_replicate=dp_replicate,
        cp_layout=cp_layout, recompute=recompute, recompute_layers=recompute_layers)
    optimizers = build_optimizers(hybrid, cfg, zero)
    first, last = any(s.is_first for s in hybrid.stages), hybrid.is_last

    def batch(step):   # this rank's rows (by dp) and (cp > 1) its shard of each sequence
        x, y = (data.shard(t, mesh.coords["dp"], dp) for t in reference.batch(model, cfg, step))
        if cp > 1:   # a mean over equal shards: the mean of the cp ranks' losses is the batch's
            x, y = (shard_sequence(t, mesh["cp"], cp_layout, dim=1) for t in (x, y))
        return x if first else None, y if last else None
    trainer = Trainer(ctx, cfg, hybrid.module, optimizer=optimizers, batch=batch,
                      forward_backward=hybrid.forward_backward,
                      after_backward=hybrid.sync_gradients,
                      optimizer_region=None).fit()
    with ctx.off_the_record():
        params = {model_name[k]: v for k, v in hybrid.full_params().items()}
    comm = label_dp(mesh.label_comm(ctx.comm.summary(by=("op", "group", "tag"))), hybrid)
    return trainer.result(stage_params=params, coords=mesh.coords, mesh_table=mesh.table(),
                          is_last=last, comm_by_group=comm, held_params=hybrid.stage_params,
                          held_expert_params=hybrid.expert_params)


def build_optimizers(hybrid, cfg, zero):
    """The run's optimizer over each of the mesh's gradient groups, as one `Optimizers`: ZeRO-1
    and ZeRO-2 wrap it in `ShardedOptimizer(stage=zero)` over the group (ZeRO-3: a plain one
    over FullyShard's shards is already 1/dp_shard). The memory watch: this rank's stages and
    their states; ZeRO-2's gradients are its shards (and the bucket in flight)."""
    optimizer_class, options = reference.optimizer_spec(cfg)
    optimizers = Optimizers(
        ShardedOptimizer(params, optimizer_class, group=group, stage=zero, **options)
        if zero in (1, 2) else optimizer_class(params, **options)
        for params, group in hybrid.gradient_groups)
    module = hybrid.module
    grads = (lambda: [g for o in optimizers.optimizers for g in o.gradient_tensors()]) \
        if zero == 2 else (lambda: [p.grad for p in module.parameters()])
    hybrid.ctx.memory.watch(params=lambda: list(module.parameters()), grads=grads,
                            optimizer_state=lambda: list(optimizer_state_tensors(optimizers)))
    return optimizers


ZERO1_TAGS = ("params of rank", "param bucket", "grad bucket", "grad norm", "optimizer state")


def label_dp(rows, hybrid):
    """Under ZeRO-3 the DP traffic by torchtitan's names: FullyShard's gathers ("params ...")
    and reduce-scatters ("grads ...") on `dp_shard` (which spans cp too when cp > 1), HSDP's
    all-reduce across `dp_replicate` (by tag and group: a one-rank dp_shard has the ranks, so
    the name, of other groups). With cp > 1 and ZeRO-0/1 the gradients' all-reduce over
    dp x cp is `dp_cp`, the experts' (ZeRO-1's too) over their replicas `ep_dp`."""
    if hybrid.dp_shard is None:
        cp = hybrid.mesh.sizes["cp"] > 1
        dense = "dp_cp" if cp else "dp"
        for row in rows:   # by tag: with dp = 1 the dp_cp group has the cp group's ranks,
            # with dp = ep (experts) the dp group has the ep group's
            zero1 = (cp or hybrid.experts) and row["tag"].startswith(ZERO1_TAGS)
            if row["tag"].startswith("dp_cp") or (zero1 and row["group"] == hybrid.dp_cp.name):
                row["dim"] = dense
            elif zero1 and row["group"] == hybrid.ep_dp.name:   # the experts' replicas
                row["dim"] = "ep_dp"
        return rows
    for row in rows:   # the experts' FullyShard runs on their replicas (ep_shard: "ep_dp")
        fsdp = row["tag"].startswith(("params ", "grads "))
        if fsdp and hybrid.ep_shard is not None and row["group"] == hybrid.ep_shard.name:
            row["dim"] = "ep_dp"
        elif fsdp and row["group"] == hybrid.dp_shard.name:
            row["dim"] = "dp_shard"
        elif row["tag"].startswith("dp_replicate"):
            row["dim"] = "dp_replicate"
    return rows


def merge_results(results, dp):
    """Rank 0's entry carries the global loss (the mean of the dp replicas' last stages) and
    the whole model's parameters (the union of every rank's stages and experts)."""
    last = [r for r in results if r["is_last"] and r["coords"]["tp"] == 0]
    params = {k: v for r in reversed(results) for k, v in r["stage_params"].items()}
    return [dict(results[0], loss=mean_loss(last, key="loss"), params=params)] + results[1:]


def dp_comm_by_rank(results, steps, dp, dp_replicate, microbatches, cp=1, ep=1):
    """Per rank, ZeRO-3's DP bytes on the wire (ring model) by dimension over the run: those
    its comm log counted (`measured`) and theory/hybrid.fsdp_wire_bytes (`predicted`; the
    shard group is dp_shard x cp, the experts' dp_shard x cp / ep: "ep_dp"); `held`: its
    stages' parameters after TP and of them its experts', before FullyShard."""
    out = []
    for r in results:
        per_step = theory_hybrid.fsdp_wire_bytes(
            r["held_params"], dp // dp_replicate * cp, dp_replicate, microbatches,
            expert_params=r["held_expert_params"], ep=ep)
        measured = {dim: sum(row["wire_bytes_per_rank"] for row in r["comm_by_group"]
                             if row["dim"] == dim) for dim in per_step}
        out.append(dict(rank=r["rank"], measured=measured,
                        predicted={k: v * steps for k, v in per_step.items()},
                        held=dict(params=r["held_params"],
                                  experts=r["held_expert_params"])))
    return out


def add_arguments(parser):
    """Options of `python -m labkit run hybrid` (the world size is dp x tp x pp)."""
    parser.set_defaults(world_size=None)
    for name, help_ in (("dp", "data-parallel replicas"), ("tp", "tensor-parallel degree"),
                        ("pp", "pipeline stages"), ("ep", "expert-parallel degree (MoE)")):
        parser.add_argument(f"--{name}", type=int, default=2 if name != "ep" else 1,
                            help=help_)
    parser.add_argument("--zero", type=int, default=0,
                        help="0, 1 or 2 (ShardedOptimizer over the DP group; 2: pp = 1) or 3 "
                             "(FullyShard over dp_shard)")
    parser.add_argument("--dp-replicate", type=int, default=1,
                        help="HSDP (--zero 3): replicas of dp_shard = dp / dp_replicate ranks")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--virtual", type=int, default=2, help="stages per rank (interleaved)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--experts", type=int, default=0, help="MoE experts (0: dense GPT)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel degree: each rank holds 1/cp of each sequence")
    parser.add_argument("--cp-layout", choices=LAYOUTS, default="zigzag",
                        help="which positions a cp rank holds (zigzag balances causal work)")
    parser.add_argument("--order", default=",".join(DIMS),
                        help="mesh dimensions outermost to innermost (default pp,dp,cp,tp)")


def report(world_size=None, cfg=None, cluster="8xH100-NVLink", dp=2, tp=2, pp=2, ep=1, zero=0,
           schedule="1f1b", microbatches=2, virtual=2, sequence_parallel=False, experts=0,
           top_k=2, order=",".join(DIMS), dp_replicate=1, timeout_s=180, cp=1,
           cp_layout="zigzag", recompute=False, recompute_layers=None, **_):
    """Run the hybrid and return the run report (runs/report.py; + mesh table, comm by group;
    cp > 1: `predicted_cp_wire_bytes`, the ring's bytes over the run summed over ranks)."""
    cfg = cfg or reference.RunConfig(model_kwargs=dict(layers=2))
    check_config(cfg, dp, tp, pp, ep, zero, schedule, microbatches, virtual, sequence_parallel,
                 experts, top_k, dp_replicate, cp, cp_layout)
    check_recompute(recompute, recompute_layers, virtual if schedule == "interleaved" else 1,
                    zero)
    world = dp * tp * pp * cp
    if world_size not in (None, world):
        dims = "dp x tp x pp" + (" x cp" if cp > 1 else "")
        raise ValueError(f"--world-size {world_size} but {dims} = {world}: drop "
                         "--world-size (the mesh sets it)")
    dims = tuple(d.strip() for d in order.split(",")) if isinstance(order, str) else order
    if sorted(dims) != sorted(DIMS):
        raise ValueError(f"--order must name {', '.join(DIMS)} once each, got {order}")
    run = run_config(cfg, experts, top_k)
    options = dict(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, schedule=schedule,
                   microbatches=microbatches, virtual=virtual,
                   sequence_parallel=sequence_parallel, dp_replicate=dp_replicate, cp=cp,
                   cp_layout=cp_layout, recompute=recompute,
                   recompute_layers=recompute_layers)
    results = launch_checked("hybrid", train, world, run, dict(options, order=dims),
                             cli_options=dict(options, experts=experts, top_k=top_k),
                             cluster=cluster, timeout_s=timeout_s)
    results = merge_results(results, dp)
    v = virtual if schedule == "interleaved" else 1
    shape = models.GPTConfig(**cfg.model_kwargs)   # the dense shape (run adds moe=)
    return build_report(
        "hybrid", run, results, reference=reference.train(run),
        exact=reference.float64_reference(run),
        config=dict(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, dp_replicate=dp_replicate,
                    schedule=schedule,
                    microbatches=microbatches, virtual=v, sequence_parallel=sequence_parallel,
                    experts=experts, top_k=top_k if experts else None, order=list(dims),
                    cp=cp, cp_layout=cp_layout),
        predicted_memory=None if experts else theory_hybrid.tiny_gpt_memory(
            **models.GPTConfig(**run.model_kwargs).as_dict(), global_batch=run.global_batch,
            dp=dp, tp=tp, pp=pp, microbatches=microbatches, virtual=v,
            sequence_parallel=sequence_parallel, zero=zero, optimizer=run.optimizer,
            dp_replicate=dp_replicate, cp=cp),
        dp_comm_by_rank=dp_comm_by_rank(results, run.steps, dp, dp_replicate, microbatches, cp,
                                        ep) if zero == 3 else None,
        predicted_cp_wire_bytes=theory_hybrid.cp_wire_bytes(
            layers=shape.layers, micro_batch=run.global_batch // (dp * microbatches),
            heads=shape.heads, seq=shape.seq, head_dim=shape.hidden // shape.heads, dp=dp,
            tp=tp, cp=cp, microbatches=microbatches) * run.steps if cp > 1 else None,
        comm_by_dim=comm_by_dim(r["comm_by_group"] for r in results),
        mesh_table=results[0]["mesh_table"],
        bubble_fraction_formula=schedules.bubble_formula(pp, microbatches, v))
