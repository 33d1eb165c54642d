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

from ..parallel.data_parallel import DistributedDataParallel
from ..parallel.fully_shard import (OFFLOAD_LINK, FullyShard, layer_units,
                                    one_unit_per_layer)
from ..parallel.mixed_precision import MasterWeights
from ..parallel.zero import ShardedOptimizer
from ..runtime.memory import optimizer_state_tensors
from ..theory import zero as theory
from .reference import (RunConfig, activation_bytes, batch, build_model, build_optimizer,
                        check_batch, optimizer_spec, train_mixed_precision)
from .report import build_report, launch_checked, single_device
from .trainer import Trainer, rows
from .report import mean_loss as global_loss   # the full-batch loss of shard losses

__all__ = ["BUCKET_MB", "COMPUTE_DTYPE", "OFFLOAD_LINK", "STAGES", "add_arguments",
           "check_config", "global_loss", "report", "train"]

STAGES = (1, 2, 3)
COMPUTE_DTYPE = torch.bfloat16   # weights and gradients under --mixed-precision
BUCKET_MB = 0.1   # the tiny GPT (0.47 MB of fp32 gradients) in several buckets: overlap shows
BLOCKS = {1: "DataParallel + ShardedOptimizer(stage=1)", 2: "ShardedOptimizer(stage=2)",
          3: "FullyShard"}


def check_config(cfg, world_size, stage, offload=False):
    """Refuse, in one line, what cannot run (called before any rank starts)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    check_batch(cfg, world_size)
    if offload and stage != 3:
        raise ValueError("--offload keeps FullyShard's shards in host memory: use --stage 3")


# ------------------------------------------------------------------------------------- training

def _setup(ctx, cfg, stage, mixed_precision, offload, prefetch):
    """(the module to call, optimizer, the flat buffers' sizes for the comm plan)."""
    model = build_model(cfg).to(ctx.device)
    dtype = COMPUTE_DTYPE if mixed_precision else None
    if stage == 3:
        sharded = FullyShard(model, compute_dtype=dtype, offload=offload, prefetch=prefetch,
                             units=one_unit_per_layer(model))
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
            module = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB,
                                             gradient_as_bucket_view=True)
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
    `reference.train_mixed_precision(cfg, COMPUTE_DTYPE)`. `step_callback(step)`, if given,
    runs after each step.
    """
    cfg = cfg or RunConfig()
    check_config(cfg, ctx.world_size, stage, offload)
    module, optimizer, flats = _setup(ctx, cfg, stage, mixed_precision, offload, prefetch)
    model = module.module if hasattr(module, "module") else module
    dtype = COMPUTE_DTYPE if mixed_precision else None

    def local_batch(step):   # this rank's rows, on its device (and in bf16)
        x, y = (t.to(ctx.device) for t in rows(ctx, batch, cfg, model)(step))
        if dtype is not None and stage < 3:   # FullyShard casts its inputs itself
            x, y = (t.to(dtype) if t.is_floating_point() else t for t in (x, y))
        return x, y

    samples, step_samples = [len(ctx.memory.samples)], []

    def after_step(step):   # the memory samples of the last step, for the report
        step_samples[:] = ctx.memory.samples[samples[0]:]
        if step_callback is not None:
            step_callback(step)
        samples[0] = len(ctx.memory.samples)
    # the sharded step (ShardedOptimizer / FullyShard) is the optimizer the trainer calls;
    # the memory watch was set up by _setup (stage 3: the optimizer state, or none offloaded)
    trainer = Trainer(
        ctx, cfg, model, lambda _: module, optimizer=optimizer, batch=local_batch, samples=True,
        after_step=after_step,
        after_backward=getattr(module, "finish_gradient_synchronization", None),
        optimizer_region="optimizer step (host)" if offload else "optimizer step").fit()
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
    return trainer.result({k: v.cpu() for k, v in params.items()} if ctx.rank == 0 else None,
                          local_loss=trainer.losses, step_memory=list(step_samples),
                          flat_numels=flats, offloaded_bytes=host,
                          padded_numel=module.padded_numel if stage == 3 else sum(flats),
                          param_count=sum(p.numel() for p in build_model(cfg).parameters()))


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
    """Run ZeRO training and return the run report (runs/report.py)."""
    cfg = cfg or RunConfig()
    options = dict(stage=stage, mixed_precision=mixed_precision, offload=offload,
                   prefetch=not no_prefetch)
    results = launch_checked("zero", train, world_size, cfg, options, cluster=cluster,
                             check=lambda: check_config(cfg, world_size, stage, offload))
    results[0] = dict(results[0], loss=global_loss(results))
    elem_bytes = 2 if mixed_precision else 4
    flats, psi = results[0]["flat_numels"], results[0]["param_count"]
    model = build_model(cfg)
    memory = theory.memory_per_rank(
        psi, world_size, stage, activation_bytes(model, cfg.global_batch // world_size),
        [sum(p.numel() for p in m.parameters()) for _, m in layer_units(model)],
        cfg.optimizer, mixed_precision, offload)
    plan = theory.comm_plan(flats, world_size, stage, elem_bytes)
    return build_report(
        "zero", cfg, results,
        **(dict(reference=train_mixed_precision(cfg, COMPUTE_DTYPE), exact=None)
           if mixed_precision else single_device(cfg)),
        config=dict(options, param_count=psi, padded_param_count=results[0]["padded_numel"],
                    block=BLOCKS[stage], reference="mixed-precision single device"
                    if mixed_precision else "fp32 single device"),
        predicted_memory=memory,
        predicted_comm_bytes_per_rank=theory.plan_wire_bytes(plan, world_size) * cfg.steps,
        formula_comm_bytes_per_rank=theory.formula_wire_bytes(psi, world_size, stage,
                                                              elem_bytes) * cfg.steps,
        offloaded_bytes=results[0]["offloaded_bytes"], flat_numels=flats,
        step_memory={r["rank"]: r["step_memory"] for r in results})
