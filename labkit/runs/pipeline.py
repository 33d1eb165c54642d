"""Pipeline parallelism (schedules, micro-batches, the bubble) on labkit's GPT or MLP.

The thin driver: the model is cut with `split_into_stages`, each rank runs its stage(s) with
torch's schedule classes (`Schedule1F1B`, ...: labkit.parallel.pipeline; "naive" or a schedule
given as data: `PipelineSchedule`), and the run is compared with the
single-device reference and reported. `bubble_fraction` is *modelled*: read off the virtual
clock's timeline (compute bars of every rank over the step's span), not measured wall time.
The formulas: theory/pipeline.py (schedules, bubble), theory/pipeline_memory.py (bytes).
"""
import torch
import torch.nn as nn

from .. import models
from ..parallel.hybrid import pipeline_schedule
from ..parallel.pipeline import PipelineStage, split_into_stages
from ..theory import pipeline as schedules
from ..theory import pipeline_memory as theory
from ..theory.memory import fp32_rank_bytes
from . import reference
from .report import build_report, launch_checked, single_device, sweep_runs
from .trainer import Trainer

SCHEDULES = schedules.SCHEDULES


# ============================================================== labkit's models as stages

def model_layers(model):
    """The model as an nn.Sequential of layers to cut: TinyGPT's embeddings, blocks and head;
    the MLP's Linear + GELU pairs (the last Linear alone). Modules are shared, not copied."""
    if isinstance(model, models.TinyGPT):
        return model.as_sequential()
    if isinstance(model, models.MLP):
        *hidden, last = model.layers
        return nn.Sequential(*[nn.Sequential(layer, nn.GELU()) for layer in hidden], last)
    raise TypeError(f"the pipeline driver knows TinyGPT and MLP, not {type(model).__name__}")


def check_config(cfg, world_size, schedule, microbatches, virtual, split=None):
    """Every mistake that can be seen before ranks start, as one ValueError line (counts below
    one end earlier, in runs/preflight.py)."""
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    if cfg.global_batch % microbatches:
        raise ValueError(f"the batch of {cfg.global_batch} does not split into {microbatches} "
                         f"equal micro-batches: pick --microbatches dividing {cfg.global_batch}")
    model = reference.build_model(cfg)   # --layers counts the GPT's blocks, the MLP's Linears
    layers = len(model.blocks) if cfg.model == "gpt" else len(model.layers)
    n_stages = world_size * virtual
    if n_stages > layers:
        what = "GPT layers (blocks)" if cfg.model == "gpt" else "MLP layers"
        fix = (f"pass --layers {n_stages} (or more)" if cfg.model == "gpt" else
               f"use at most {layers} stages (world size x virtual)")
        raise ValueError(f"{n_stages} pipeline stages need at least {n_stages} {what}, the "
                         f"model has {layers}: {fix}")
    schedules.make_schedule(schedule, world_size, microbatches, virtual)
    split_into_stages(model_layers(model), n_stages, balance=split or "params")


# ======================================================================= a training run

def train(ctx, cfg, schedule="1f1b", microbatches=4, virtual=1, recompute=False, split=None):
    """Train `cfg` with the pipeline on ctx.world_size ranks; returns this rank's result.

    `schedule` is a name or the data (a list of per-rank op lists, e.g. a learner's own).
    `split`: layers per stage (default: balanced by parameter count).
    """
    p = ctx.world_size
    n = 1 if schedule == "naive" else microbatches
    mine = []

    def pp_parallelize(model):   # cut into P x V stages; keep this rank's r, r + P, ...
        modules = split_into_stages(model_layers(model), p * virtual, balance=split or "params")
        stages = range(ctx.rank, p * virtual, p)
        mine.extend(PipelineStage(modules[s], s, p * virtual) for s in stages)
        return nn.ModuleList(s.module for s in mine)
    model = reference.build_model(cfg)
    # the schedule runs every micro-batch's forward and backward on this rank's stages and
    # sends activations and gradients between ranks; only the last stage has a loss
    trainer = Trainer(ctx, cfg, model, pp_parallelize, optimizer=reference.build_optimizer,
                      batch=lambda step: reference.batch(model, cfg, step),
                      forward_backward=lambda x, y: mean_loss(pipe, x, y),
                      optimizer_region=None)   # no clock region, as this driver always stepped
    pipe = pipeline_schedule(mine, n, reference.loss_fn(cfg), schedule, recompute=recompute)
    trainer.fit()
    own = {id(q) for q in trainer.module.parameters()}
    named = {k: q.detach().clone() for k, q in model.named_parameters() if id(q) in own}
    sizes = stage_sizes(cfg, [s.module for s in mine], cfg.global_batch // n)
    return trainer.result(stage_params=named,
                          predicted_activations=theory.peak_activation_bytes(
                              pipe.schedule, ctx.rank, [a for a, _ in sizes], recompute),
                          in_flight=schedules.microbatches_in_flight(pipe.ops),
                          schedule=pipe.schedule)


def mean_loss(pipe, x, target):
    """One step of `pipe`; the micro-batches' mean loss on the last stage (torch's step
    returns the outputs and fills `losses`), else None."""
    losses = []
    pipe.step(x, target=target, losses=losses)
    return torch.stack(losses).mean() if losses else None


def sweep(ctx, cfg, runs):
    """Several pipeline runs in one launch: `report.sweep_runs` with this driver's `train`."""
    return sweep_runs(ctx, cfg, runs, train)


def merge_results(results):
    """The report's view: loss from the last stage, parameters put together from all stages
    (outside the run, so the comm log holds only the pipeline's own traffic)."""
    first = dict(results[0])
    first["loss"] = results[-1]["loss"]
    first["params"] = {k: v for r in results for k, v in r["stage_params"].items()}
    return [first] + list(results[1:])


# ==================================================== the stages as theory/ counts them

def stage_sizes(cfg, modules, batch):
    """Each stage in `modules` as theory/pipeline_memory.stage_sizes counts it: the GPT's
    blocks and head, the MLP's Linears (each in a Linear + GELU pair, but the model's last)."""
    if cfg.model == "gpt":
        c = models.GPTConfig(**cfg.model_kwargs)
        return theory.stage_sizes(
            [(sum(isinstance(m, models.Block) for m in stage),
              any(type(m).__name__ == "_NormHead" for m in stage)) for stage in modules],
            batch, dict(seq=c.seq, hidden=c.hidden, heads=c.heads, vocab=c.vocab))
    stages = []
    for stage in modules:   # Linear + GELU pairs, and the model's last Linear alone
        linears = [(m[0] if isinstance(m, nn.Sequential) else m) for m in stage]
        stages.append(([(m.in_features, m.out_features) for m in linears],
                       not isinstance(stage[-1], nn.Sequential)))
    return theory.stage_sizes(stages, batch)


# ============================================================================ the report

def add_arguments(parser):
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages P, one per rank (default: the world size)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches M per step")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--virtual", type=int, default=2,
                        help="stages V per rank for the interleaved schedule")
    parser.add_argument("--recompute", action="store_true",
                        help="keep only stage inputs; recompute the forward in backward")


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", stages=None, microbatches=4,
           schedule="1f1b", virtual=2, recompute=False, split=None, timeout_s=120, **_):
    """Run the pipeline and return the run report (bubble_fraction: modelled)."""
    cfg = cfg or reference.RunConfig()
    if stages is not None and stages != world_size:
        raise ValueError(f"--stages {stages} but --world-size {world_size}: the pipeline runs "
                         f"one stage per rank, so pass --world-size {stages} (or drop --stages)")
    m = 1 if schedule == "naive" else microbatches
    v = virtual if schedule == "interleaved" else 1
    options = dict(schedule=schedule, microbatches=m, virtual=v, recompute=recompute,
                   split=split)
    results = merge_results(launch_checked(
        "pipeline", train, world_size, cfg, options, cluster=cluster, timeout_s=timeout_s,
        check=lambda: check_config(cfg, world_size, schedule, m, v, split)))
    timeline = [e for r in results for e in r["timeline"]]
    ops, batch = results[0]["schedule"], cfg.global_batch // m
    mine = split_into_stages(model_layers(reference.build_model(cfg)), world_size * v,
                             balance=split or "params")[::world_size]   # rank 0's stages
    sizes = stage_sizes(cfg, mine, batch)
    memory = fp32_rank_bytes(sum(q.numel() for stage in mine for q in stage.parameters()),
                             theory.peak_activation_bytes(ops, 0, [a for a, _ in sizes],
                                                          recompute), cfg.optimizer)
    return build_report(
        "pipeline", cfg, results, **single_device(cfg),
        config=dict(stages=world_size, microbatches=m, schedule=schedule, virtual=v,
                    recompute=recompute),
        predicted_memory=memory,
        predicted_comm_bytes_per_rank=theory.send_bytes(ops, 0, [b for _, b in sizes], batch,
                                                        cfg.steps),
        bubble_fraction=schedules.timeline_bubble_fraction(timeline, world_size),
        bubble_fraction_formula=schedules.bubble_formula(world_size, m, v),
        bubble_fraction_free_links=schedules.timeline_bubble_fraction(
            schedules.simulate_like(timeline, ops)),
        bubble_note="modelled: read off the virtual clock on the cluster, not wall time",
        in_flight_stage0=results[0]["in_flight"],
        schedule_table=schedules.format_schedule(ops))
