"""Data parallelism on N ranks: labkit's model trained with DDP, checked, reported.

`python -m labkit run dp --world-size N [--mode naive|bucketed] [--bucket-mb X] [--no-overlap]
[--accumulate K] --json`. Two modes: "bucketed" wraps the model in `DistributedDataParallel` (async
bucket all-reduces started from backward hooks, what PyTorch DDP does); "naive": after
backward, one blocking all-reduce per gradient (`average_gradients(per_tensor=True)`). Both
end with the parameters of one device trained on the full batch. Also here, for lesson 01:
inference data parallelism (`infer`).
The block (and `ring_all_reduce`, the ring from send and recv): labkit/parallel/data_parallel.py;
the formulas: labkit/theory/data_parallel.py.
"""
import torch

from ..parallel.data_parallel import DistributedDataParallel
from ..parallel.flat import average_gradients
from ..theory import data_parallel as theory
from .reference import (RunConfig, batch, build_model, build_optimizer, check_batch, full_params,
                        predict_memory)
from .report import build_report, launch_checked, single_device
from .report import mean_loss as global_loss   # the full-batch loss of shard losses
from .trainer import Trainer, rows

__all__ = ["DEFAULT_BUCKET_MB", "MODES", "add_arguments", "check_config", "global_loss", "infer",
           "report", "train"]

DEFAULT_BUCKET_MB = 0.25   # the tiny model's gradients are ~0.47 MB: two buckets
MODES = ("bucketed", "naive")


def check_config(cfg, world_size, mode="bucketed", accumulate=1):
    """Refuse, in one line, what cannot run (called before any rank starts)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive integer, got {accumulate!r}")
    check_batch(cfg, world_size, accumulate)


# ------------------------------------------------------------------------------------- training

def train(ctx, cfg=None, mode="bucketed", bucket_mb=DEFAULT_BUCKET_MB, overlap=True,
          accumulate=1):
    """Data-parallel training on this rank; returns `rank_result` (params on rank 0).

    The losses it returns are this rank's (its shard's mean); `global_loss(results)` averages
    them over ranks into the full-batch loss (equal shards: the mean of means is the mean).
    """
    cfg = cfg or RunConfig()
    check_config(cfg, ctx.world_size, mode, accumulate)
    wrap = None if mode == "naive" else (
        lambda model: DistributedDataParallel(model, bucket_cap_mb=bucket_mb, overlap=overlap))

    def synchronise():   # after backward: the gradients averaged over the ranks
        if mode == "naive":   # one blocking all-reduce per gradient
            average_gradients(trainer.module.parameters(), per_tensor=True, tag="grad")
        else:   # already done by the bucket hooks in backward; kept to show where it happens
            trainer.module.finish_gradient_synchronization()
    # accumulating, DDP's inner micro-batches run under no_sync: the last one syncs
    model = build_model(cfg)
    trainer = Trainer(ctx, cfg, model, wrap, optimizer=build_optimizer,
                      batch=rows(ctx, batch, cfg, model), accumulate=accumulate,
                      after_backward=synchronise)
    trainer.fit()
    return trainer.result(full_params(trainer.model) if ctx.rank == 0 else None,
                          local_loss=trainer.losses, step_wall_s=trainer.step_wall)


# ------------------------------------------------------------------------------- inference

def infer(ctx, cfg=None, batches=()):
    """Inference data parallelism: replica r runs batches r, r+N, r+2N, ... on its own copy.

    No communication at all: each batch is independent. Returns this rank's outputs
    ({batch index: output}) and the modelled seconds of each of its batches.
    """
    cfg = cfg or RunConfig()
    model = build_model(cfg).eval()
    outputs, times = {}, []
    for i in range(ctx.rank, len(batches), ctx.world_size):
        start = ctx.clock.now()
        with torch.no_grad(), ctx.clock.compute(f"batch {i}"):
            outputs[i] = model(batches[i])
        times.append(ctx.clock.now() - start)
        ctx.clock.mark_step()
    return dict(rank=ctx.rank, outputs=outputs, batch_s=times, finished_s=ctx.clock.now(),
                timeline=ctx.clock.timeline(), wall_s=ctx.elapsed())


# ----------------------------------------------------------------------------- CLI and report

def add_arguments(parser):
    """Options of `python -m labkit run dp`."""
    parser.add_argument("--mode", choices=MODES, default="bucketed",
                        help="bucketed (DistributedDataParallel, async) or naive (one "
                             "all-reduce per tensor after backward)")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB,
                        help="gradient bucket size in MB (1e6 bytes)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="start the bucket all-reduces after backward, not during it")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per step (gradient accumulation, one sync)")


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", bucket_mb=DEFAULT_BUCKET_MB,
           no_overlap=False, accumulate=1, mode="bucketed", **_):
    """Run data-parallel training and return the run report (runs/report.py)."""
    cfg = cfg or RunConfig()
    options = dict(mode=mode, bucket_mb=bucket_mb, overlap=not no_overlap, accumulate=accumulate)
    results = launch_checked("dp", train, world_size, cfg, options, cluster=cluster,
                             check=lambda: check_config(cfg, world_size, mode, accumulate))
    results[0] = dict(results[0], loss=global_loss(results))
    model = build_model(cfg)
    grad_bytes = theory.gradient_bytes(model)
    # a whole replica per rank, the activations of its 1/(N x K) of the batch, the buckets
    memory = predict_memory(cfg, model, cfg.global_batch // (world_size * accumulate),
                            buffers=grad_bytes if mode == "bucketed" else 0)
    return build_report("dp", cfg, results, **single_device(cfg),
                        config=dict(options, gradient_bytes=grad_bytes),
                        predicted_memory=memory,
                        predicted_comm_bytes_per_rank=theory.ring_all_reduce_bytes(
                            grad_bytes, world_size, cfg.steps))
