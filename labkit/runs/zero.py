"""ZeRO stages 1-3 on N ranks: labkit's model trained with the blocks, checked, reported.

`python -m labkit run zero --stage S --world-size N [--mixed-precision] [--offload] --json`.
stage 1: `DataParallel` averages the gradients, `ShardedOptimizer(stage=1)` keeps the optimizer
state of its parameters only and sends them out after its step; stage 2: `ShardedOptimizer`
reduce-scatters the gradients itself and keeps its shard of them; stage 3: `FullyShard` shards
the weights too (units: the model's layers). Each run ends with the parameters of one device
trained on the whole batch (fp32), or of one device running the same mixed-precision algorithm
(bf16 compute, fp32 master weights that start from the unrounded fp32 initialisation).
The blocks: labkit/parallel/zero.py, labkit/parallel/fully_shard.py; formulas: theory/zero.py.
"""
import torch
import torch.nn as nn

from .. import data
from ..parallel.data_parallel import DataParallel
from ..parallel.fully_shard import OFFLOAD_LINK, FullyShard
from ..parallel.mixed_precision import MasterWeights
from ..parallel.zero import ShardedOptimizer
from ..runtime.memory import optimizer_state_tensors
from ..theory import memory as theory_memory
from ..theory import zero as theory_zero
from .reference import (RunConfig, activation_bytes, batch, build_model, build_optimizer,
                        optimizer_spec, train as reference_train)
from .reference import float64_reference
from .report import build_report, rank_result
from .report import mean_loss as global_loss   # the full-batch loss of shard losses

__all__ = ["BUCKET_MB", "COMPUTE_DTYPE", "OFFLOAD_LINK", "STAGES", "add_arguments",
           "check_config", "comm_plan", "formula_wire_bytes", "global_loss", "layer_units",
           "predict_memory", "predicted_wire_bytes", "reference_mixed_precision", "report",
           "train"]

STAGES = (1, 2, 3)
COMPUTE_DTYPE = torch.bfloat16   # weights and gradients under --mixed-precision
BUCKET_MB = 0.1   # the tiny GPT (0.47 MB of fp32 gradients) in several buckets: overlap shows
comm_plan, formula_wire_bytes = theory_zero.comm_plan, theory_zero.formula_wire_bytes


def check_config(cfg, world_size, stage, offload=False):
    """Refuse, in one line, what cannot run (called before any rank starts)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if world_size < 1 or cfg.global_batch % world_size:
        raise ValueError(f"the global batch of {cfg.global_batch} does not split over "
                         f"{world_size} ranks; use a multiple of {world_size} (--batch)")
    if offload and stage != 3:
        raise ValueError("--offload keeps FullyShard's shards in host memory: use --stage 3")


def layer_units(model):
    """The model cut into layers, in forward order: each child, each ModuleList entry."""
    units = []
    for name, child in model.named_children():
        members = ([(f"{name}.{i}", m) for i, m in enumerate(child)]
                   if isinstance(child, nn.ModuleList) else [(name, child)])
        units += [(n, m) for n, m in members if any(True for _ in m.parameters())]
    return units


# ------------------------------------------------------------------------------------- training

def _setup(ctx, cfg, stage, mixed_precision, offload, prefetch):
    """(the module to call, optimizer, the flat buffers' sizes for the comm plan)."""
    model = build_model(cfg).to(ctx.device)
    dtype = COMPUTE_DTYPE if mixed_precision else None
    if stage == 3:
        layers = {id(m) for _, m in layer_units(model)}
        sharded = FullyShard(model, compute_dtype=dtype, offload=offload, prefetch=prefetch,
                             units=lambda m: id(m) in layers)
        optimizer = build_optimizer(sharded.parameters(), cfg)
        ctx.memory.watch(optimizer_state=lambda: [] if offload
                         else optimizer_state_tensors(optimizer))
        return sharded, optimizer, sharded.unit_numels
    inner, options = optimizer_spec(cfg)
    if mixed_precision:
        unrounded = {p: p.detach().clone() for p in model.parameters()}
        model.to(dtype)   # in place: the parameters keep their identity
        inner, options = MasterWeights, dict(options, inner=inner)
    module = model
    if stage == 1:   # its first broadcast is set-up (every rank built the same weights)
        with ctx.off_the_record():
            module = DataParallel(model, bucket_mb=BUCKET_MB, gradient_as_bucket_view=True)
    optimizer = ShardedOptimizer(model.parameters(), inner, stage=stage, bucket_mb=BUCKET_MB,
                                 **options)
    if mixed_precision:   # the masters start from the fp32 weights, not their bf16 rounding
        optimizer.optim.load_masters(optimizer.local_part(unrounded))
    flats = [sum(p.numel() for p in model.parameters())] if stage == 1 \
        else [b.padded for b in optimizer.buckets]
    return module, optimizer, flats


def train(ctx, cfg=None, stage=1, mixed_precision=False, offload=False, prefetch=True,
          step_callback=None):
    """ZeRO training on this rank; returns `rank_result` with the full params on rank 0.

    fp32: compare with `reference.train`; mixed_precision (bf16 compute, fp32 masters): with
    `reference_mixed_precision`. `step_callback(step)`, if given, runs after each step.
    """
    cfg = cfg or RunConfig()
    check_config(cfg, ctx.world_size, stage, offload)
    module, optimizer, flats = _setup(ctx, cfg, stage, mixed_precision, offload, prefetch)
    model = module.module if hasattr(module, "module") else module
    dtype = COMPUTE_DTYPE if mixed_precision else None
    losses, step_samples = [], []
    for step in range(cfg.steps):
        first_sample = len(ctx.memory.samples)
        with ctx.step(step, cfg.steps):
            optimizer.zero_grad(set_to_none=True)
            x, y = (data.shard(t, ctx.rank, ctx.world_size).to(ctx.device)
                    for t in batch(model, cfg, step))
            if dtype is not None and stage < 3:   # FullyShard casts its inputs itself
                x, y = (t.to(dtype) if t.is_floating_point() else t for t in (x, y))
            with ctx.memory.track_activations():
                with ctx.clock.compute("forward"):
                    loss = module(x, y)
                ctx.memory.sample("after forward")
                with ctx.clock.compute("backward"):
                    loss.backward()
            if hasattr(module, "finish_gradient_synchronization"):
                module.finish_gradient_synchronization()
            ctx.memory.sample("after backward")
            with ctx.clock.compute("optimizer step (host)" if offload else "optimizer step"):
                optimizer.step()
        losses.append(loss.item())
        step_samples = ctx.memory.samples[first_sample:]
        if step_callback is not None:
            step_callback(step)
    if stage == 3:
        params = module.full_state_dict()
    elif mixed_precision:
        with ctx.off_the_record():   # set-up for the report, not training traffic
            masters = optimizer.gather_full(optimizer.optim.masters)
        params = {name: masters[p] for name, p in model.named_parameters()}
    else:
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    host = (module.host_bytes() + sum(t.nbytes for t in optimizer_state_tensors(optimizer))
            if offload else 0)
    return rank_result(ctx, losses, local_loss=losses,
                       params={k: v.cpu() for k, v in params.items()} if ctx.rank == 0
                       else None,
                       step_memory=list(step_samples), flat_numels=flats,
                       padded_numel=flats[0] if stage == 1 else
                       sum(theory_zero.padded(u, ctx.world_size) for u in flats),
                       param_count=sum(p.numel() for p in build_model(cfg).parameters()),
                       offloaded_bytes=host)


def reference_mixed_precision(cfg=None):
    """One device, full batch, the mixed-precision algorithm the ranks run: a bf16 copy of the
    weights computes forward and backward; Adam steps fp32 masters that start from the
    unrounded fp32 weights; the bf16 copy is refreshed from them after each step."""
    cfg = cfg or RunConfig()
    master = build_model(cfg)
    work = build_model(cfg).to(COMPUTE_DTYPE)
    optimizer = build_optimizer(master.parameters(), cfg)
    pairs = list(zip(master.parameters(), work.parameters()))
    losses = []
    for step in range(cfg.steps):
        x, y = (t.to(COMPUTE_DTYPE) if t.is_floating_point() else t
                for t in batch(master, cfg, step))
        with torch.no_grad():
            for m, w in pairs:
                w.copy_(m)
                w.grad = None
        loss = work(x, y)
        loss.backward()
        for m, w in pairs:
            m.grad = None if w.grad is None else w.grad.float()
        optimizer.step()
        losses.append(loss.item())
    return dict(loss=losses, params={k: p.detach().clone()
                                     for k, p in master.named_parameters()})


# ------------------------------------------------------------------------------- predictions

def predict_memory(cfg, world_size, stage, mixed_precision=False, offload=False):
    """Bytes per rank: model states from theory/ (stages 1, 2: the ZeRO paper's split; stage 3:
    FullyShard's, the same total), activations for global_batch/N examples, and stage 3's
    buffers: the two largest layers gathered at once (one computing, one prefetched)."""
    model = build_model(cfg)
    psi = sum(p.numel() for p in model.parameters())
    if stage == 3:
        out = theory_zero.fully_shard_state_bytes(psi, world_size, cfg.optimizer, offload)
    else:
        out = theory_memory.model_state_bytes(psi, mixed_precision=mixed_precision,
                                              optimizer=cfg.optimizer, zero_stage=stage,
                                              world_size=world_size)
        out = {k: out[k] for k in ("params", "grads", "optimizer")}
    out["activations"] = activation_bytes(model, cfg.global_batch // world_size) \
        * (0.5 if mixed_precision else 1.0)
    largest = sorted(sum(p.numel() for p in m.parameters()) for _, m in layer_units(model))
    w = 2 if mixed_precision else 4
    out["buffers"] = w * sum(largest[-2:]) if stage == 3 and world_size > 1 else 0.0
    out["peak"] = sum(out[k] for k in ("params", "grads", "optimizer", "activations",
                                       "buffers"))
    return out


def predicted_wire_bytes(flat_numels, world_size, stage, elem_bytes):
    """Ring-model bytes per rank and step of `comm_plan` over the run's flat buffers."""
    return theory_zero.plan_wire_bytes(comm_plan(flat_numels, world_size, stage, elem_bytes),
                                       world_size)


# ------------------------------------------------------------------------------ CLI and report

def add_arguments(parser):
    """Options of `python -m labkit run zero`."""
    parser.add_argument("--stage", type=int, default=1,
                        help="1: shard optimizer state, 2: + gradients, 3: + parameters")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="bf16 compute, fp32 master weights sharded with the optimizer")
    parser.add_argument("--offload", action="store_true",
                        help="stage 3: shards and optimizer state in host memory")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="stage 3: gather each layer only when it is needed")


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", stage=1, mixed_precision=False,
           offload=False, no_prefetch=False, **_):
    """Run ZeRO training and return the run report of DESIGN.md."""
    from ..runtime.launch import launch
    cfg = cfg or RunConfig()
    check_config(cfg, world_size, stage, offload)
    results = launch(train, world_size, cfg, stage=stage, mixed_precision=mixed_precision,
                     offload=offload, prefetch=not no_prefetch, cluster=cluster)
    results[0] = dict(results[0], loss=global_loss(results))
    elem_bytes = 2 if mixed_precision else 4
    flats, psi = results[0]["flat_numels"], results[0]["param_count"]
    return build_report(
        "zero", cfg, results,
        reference=reference_mixed_precision(cfg) if mixed_precision else reference_train(cfg),
        exact=None if mixed_precision else float64_reference(cfg),
        config=dict(stage=stage, mixed_precision=mixed_precision, offload=offload,
                    prefetch=not no_prefetch, param_count=psi,
                    padded_param_count=results[0]["padded_numel"],
                    block="FullyShard" if stage == 3 else
                    "DataParallel + ShardedOptimizer(stage=1)" if stage == 1 else
                    "ShardedOptimizer(stage=2)",
                    reference="mixed-precision single device" if mixed_precision
                    else "fp32 single device"),
        predicted_memory=predict_memory(cfg, world_size, stage, mixed_precision, offload),
        predicted_comm_bytes_per_rank=predicted_wire_bytes(flats, world_size, stage,
                                                           elem_bytes) * cfg.steps,
        formula_comm_bytes_per_rank=formula_wire_bytes(psi, world_size, stage,
                                                       elem_bytes) * cfg.steps,
        offloaded_bytes=results[0]["offloaded_bytes"], flat_numels=flats,
        step_memory={r["rank"]: r["step_memory"] for r in results})
