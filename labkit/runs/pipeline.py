"""Pipeline parallelism (schedules, micro-batches, the bubble) on labkit's GPT or MLP.

The thin driver: the model is cut with `split_into_stages`, each rank runs its stage(s) with the
`PipelineSchedule` executor (labkit.parallel.pipeline), and the run is compared with the
single-device reference and reported. `bubble_fraction` is *modelled*: read off the virtual
clock's timeline (compute bars of every rank over the step's span), not measured wall time.
"""
import dataclasses

import torch.nn as nn

from .. import models
from ..parallel.pipeline import PipelineSchedule, PipelineStage, split_into_stages
from ..theory import memory as theory_memory
from ..theory import pipeline as schedules
from . import reference

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


def layer_count(cfg):
    """What --layers counts: the GPT's blocks, or the MLP's Linear layers."""
    model = reference.build_model(cfg)
    return len(model.blocks) if cfg.model == "gpt" else len(model.layers)


def check_config(cfg, world_size, schedule, microbatches, virtual, split=None):
    """Every mistake that can be seen before ranks start, as one ValueError line."""
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    if microbatches < 1:
        raise ValueError(f"--microbatches must be >= 1, got {microbatches}")
    if virtual < 1:
        raise ValueError(f"--virtual must be >= 1, got {virtual}")
    if cfg.global_batch % microbatches:
        raise ValueError(f"the batch of {cfg.global_batch} does not split into {microbatches} "
                         f"equal micro-batches: pick --microbatches dividing {cfg.global_batch}")
    n_stages, layers = world_size * virtual, layer_count(cfg)
    if n_stages > layers:
        what = "GPT layers (blocks)" if cfg.model == "gpt" else "MLP layers"
        fix = (f"pass --layers {n_stages} (or more)" if cfg.model == "gpt" else
               f"use at most {layers} stages (world size x virtual)")
        raise ValueError(f"{n_stages} pipeline stages need at least {n_stages} {what}, the "
                         f"model has {layers}: {fix}")
    schedules.make_schedule(schedule, world_size, microbatches, virtual)
    split_into_stages(model_layers(reference.build_model(cfg)), n_stages,
                      balance=split or "params")


# ======================================================================= a training run

def train(ctx, cfg, schedule="1f1b", microbatches=4, virtual=1, recompute=False, split=None):
    """Train `cfg` with the pipeline on ctx.world_size ranks; returns this rank's result.

    `schedule` is a name or the data (a list of per-rank op lists, e.g. a learner's own).
    `split`: layers per stage (default: balanced by parameter count).
    """
    from .report import rank_result
    p = ctx.world_size
    n = 1 if schedule == "naive" else microbatches
    model = reference.build_model(cfg)
    batches = [reference.batch(model, cfg, step) for step in range(cfg.steps)]
    modules = split_into_stages(model_layers(model), p * virtual, balance=split or "params")
    mine = [PipelineStage(modules[s], s, p * virtual) for s in range(ctx.rank, p * virtual, p)]
    pipe = PipelineSchedule(mine, schedule, reference.loss_fn(cfg), n, recompute=recompute)
    stage = nn.ModuleList(s.module for s in mine)
    optimizer = reference.build_optimizer(stage.parameters(), cfg)
    ctx.memory.watch(model=stage, optimizer=optimizer)
    losses = []
    for step, (x, y) in enumerate(batches):
        with ctx.step(step, cfg.steps):
            optimizer.zero_grad(set_to_none=True)
            with ctx.memory.track_activations():
                loss = pipe.step(x, target=y)
            optimizer.step()
        if loss is not None:
            losses.append(loss.item())
    own = {id(q) for q in stage.parameters()}
    named = {k: q.detach().clone() for k, q in model.named_parameters() if id(q) in own}
    batch = cfg.global_batch // n
    return rank_result(ctx, losses, stage_params=named,
                       predicted_activations=predicted_activation_bytes(
                           pipe.schedule, ctx.rank, [s.module for s in mine], batch, cfg,
                           recompute),
                       in_flight=schedules.microbatches_in_flight(pipe.ops),
                       schedule=pipe.schedule)


def sweep(ctx, cfg, runs):
    """Several pipeline runs in one launch (starting ranks is the slow part on a laptop).

    runs: list of dicts of `train` keywords, plus optional 'cluster' (for the clock) and
    'steps'. Each run gets a fresh clock, comm log and memory tracker; one result per run."""
    out, launched_on = [], ctx.clock.cluster
    for run in runs:
        run = dict(run)
        ctx.reset_instruments(run.pop("cluster", launched_on))
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


# ============================================================ memory and comm: formulas

def stage_activation_bytes(module, batch, cfg):
    """What one stage saves for backward on a micro-batch of `batch` (formula, fp32).

    TinyGPT: per block 16sbh + as^2b elements (theory.memory.tiny_gpt_activation_bytes), plus
    the last stage's ln_f / head / log-softmax. MLP: each Linear's input and GELU's input;
    the last layer's MSE keeps output and target."""
    if cfg.model == "gpt":
        c = models.GPTConfig(**cfg.model_kwargs)
        kw = dict(seq=c.seq, batch=batch, hidden=c.hidden, heads=c.heads, vocab=c.vocab)
        head = theory_memory.tiny_gpt_activation_bytes(layers=0, **kw)
        per_block = theory_memory.tiny_gpt_activation_bytes(layers=1, **kw) - head
        blocks = sum(isinstance(m, models.Block) for m in module)
        last = any(type(m).__name__ == "_NormHead" for m in module)
        return blocks * per_block + (head if last else 0)
    elements = 0
    for layer in module:
        if isinstance(layer, nn.Sequential):           # Linear + GELU
            elements += layer[0].in_features + layer[0].out_features
        else:                                           # the model's last Linear + MSE
            elements += layer.in_features + 2 * layer.out_features
    return 4 * batch * elements


def predicted_activation_bytes(schedule, rank, modules, batch, cfg, recompute=False):
    """Most activation bytes held at once on `rank`: the schedule's in-flight micro-batches
    times each stage's bytes (GPipe: M micro-batches, 1F1B: min(M, P - rank)). With recompute
    only one stage's forward is saved at a time, during its backward (the stage inputs kept
    meanwhile are counted as buffers)."""
    sizes = [stage_activation_bytes(m, batch, cfg) for m in modules]
    if recompute:
        return max(sizes)
    held, now, most = set(), 0, 0
    for kind, m, c in schedule[rank]:
        if kind == "F":
            held.add((m, c))
            now += sizes[c]
            most = max(most, now)
        elif (m, c) in held:
            held.discard((m, c))
            now -= sizes[c]
    return most


def boundary_elements(cfg, module, side):
    """Elements per sequence (GPT) or row (MLP) at a stage's input ('in') or output ('out')."""
    if cfg.model == "gpt":
        c = models.GPTConfig(**cfg.model_kwargs)
        return c.seq * c.hidden
    layer = module[0] if side == "in" else module[-1]
    layer = layer[0] if isinstance(layer, nn.Sequential) else layer
    return layer.in_features if side == "in" else layer.out_features


def predicted_send_bytes(schedule, rank, modules, batch, cfg, steps=1):
    """Bytes `rank` sends: each F's output to the next stage, each B's input gradient back."""
    p, n_stages = len(schedule), len(schedule) * len(modules)
    total = 0
    for kind, _, c in schedule[rank]:
        stage = c * p + rank
        if kind == "F" and stage < n_stages - 1:
            total += 4 * batch * boundary_elements(cfg, modules[c], "out")
        elif kind == "B" and stage > 0:
            total += 4 * batch * boundary_elements(cfg, modules[c], "in")
    return total * steps


def predict_memory(cfg, world_size, schedule="1f1b", microbatches=4, virtual=1,
                   recompute=False, split=None, rank=0):
    """theory/'s bytes on `rank`: fp32 states of its stages and the in-flight activations."""
    n = 1 if schedule == "naive" else microbatches
    modules = split_into_stages(model_layers(reference.build_model(cfg)), world_size * virtual,
                                balance=split or "params")[rank::world_size]
    count = sum(q.numel() for m in modules for q in m.parameters())
    states = theory_memory.model_state_bytes(count, mixed_precision=False,
                                             optimizer=cfg.optimizer)
    ops = schedules.make_schedule(schedule, world_size, n, virtual)
    out = dict(params=states["params"], grads=states["grads"], optimizer=states["optimizer"],
               activations=predicted_activation_bytes(ops, rank, modules, cfg.global_batch // n,
                                                      cfg, recompute))
    out["peak"] = sum(out.values())
    return out


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
    from ..runtime.launch import launch
    from .report import build_report
    cfg = cfg or reference.RunConfig()
    if stages is not None and stages != world_size:
        raise ValueError(f"--stages {stages} but --world-size {world_size}: the pipeline runs "
                         f"one stage per rank, so pass --world-size {stages} (or drop --stages)")
    m = 1 if schedule == "naive" else microbatches
    v = virtual if schedule == "interleaved" else 1
    check_config(cfg, world_size, schedule, m, v, split)
    results = merge_results(launch(train, world_size, cfg, schedule, m, v, recompute, split,
                                   cluster=cluster, timeout_s=timeout_s))
    timeline = [e for r in results for e in r["timeline"]]
    ops = results[0]["schedule"]
    stage0 = split_into_stages(model_layers(reference.build_model(cfg)), world_size * v,
                               balance=split or "params")[::world_size]
    return build_report(
        "pipeline", cfg, results, reference=reference.train(cfg),
        exact=reference.float64_reference(cfg),
        config=dict(stages=world_size, microbatches=m, schedule=schedule, virtual=v,
                    recompute=recompute),
        predicted_memory=predict_memory(cfg, world_size, schedule, m, v, recompute, split),
        predicted_comm_bytes_per_rank=predicted_send_bytes(ops, 0, stage0,
                                                           cfg.global_batch // m, cfg,
                                                           cfg.steps),
        bubble_fraction=schedules.timeline_bubble_fraction(timeline, world_size),
        bubble_fraction_formula=schedules.bubble_formula(world_size, m, v),
        bubble_fraction_free_links=schedules.timeline_bubble_fraction(
            schedules.simulate_like(timeline, ops)),
        bubble_note="modelled: read off the virtual clock on the cluster, not wall time",
        in_flight_stage0=results[0]["in_flight"],
        schedule_table=schedules.format_schedule(ops))

