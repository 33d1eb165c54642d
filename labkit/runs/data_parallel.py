"""Data parallelism on N ranks: labkit's model trained with `DataParallel`, checked, reported.

`python -m labkit run dp --world-size N [--mode naive|bucketed] [--bucket-mb X] [--no-overlap]
[--accumulate K] --json`. Two modes: "bucketed" wraps the model in `labkit.DataParallel` (async
bucket all-reduces started from backward hooks, what PyTorch DDP does); "naive": after
backward, one blocking all-reduce per gradient (`average_gradients(per_tensor=True)`). Both
end with the parameters of one device trained on the full batch. Also here, for lesson 01:
`ring_all_reduce` (the ring built from send and recv, the exercise's model answer) and
inference data parallelism (`infer`).
The block: labkit/parallel/data_parallel.py; the formulas: labkit/theory/data_parallel.py.
"""
import time
from contextlib import nullcontext

import torch

from .. import data
from ..parallel.data_parallel import DataParallel
from ..parallel.flat import average_gradients
from ..theory.data_parallel import inference_throughput, ring_all_reduce_bytes
from .reference import (RunConfig, activation_bytes, batch, build_model, build_optimizer,
                        full_params, predict_memory as single_device_memory,
                        train as reference_train)
from .reference import float64_reference
from .report import build_report, rank_result
from .report import mean_loss as global_loss   # the full-batch loss of shard losses

__all__ = ["DEFAULT_BUCKET_MB", "MODES", "add_arguments",
           "check_config", "global_loss", "gradient_bytes", "infer", "inference_throughput",
           "predict_memory", "predicted_wire_bytes", "report", "ring_all_reduce", "train"]

DEFAULT_BUCKET_MB = 0.25   # the tiny model's gradients are ~0.47 MB: two buckets
MODES = ("bucketed", "naive")


def check_config(cfg, world_size, mode="bucketed", accumulate=1):
    """Refuse, in one line, what cannot run (called before any rank starts)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive integer, got {accumulate!r}")
    if cfg.global_batch % (world_size * accumulate):
        raise ValueError(f"the global batch of {cfg.global_batch} does not split into "
                         f"{world_size} ranks x {accumulate} micro-batch(es); use a multiple "
                         f"of {world_size * accumulate} (--batch)")


# ------------------------------------------------------------------------------------- training

def train(ctx, cfg=None, mode="bucketed", bucket_mb=DEFAULT_BUCKET_MB, overlap=True,
          accumulate=1):
    """Data-parallel training on this rank; returns `rank_result` (params on rank 0).

    The losses it returns are this rank's (its shard's mean); `global_loss(results)` averages
    them over ranks into the full-batch loss (equal shards: the mean of means is the mean).
    """
    cfg = cfg or RunConfig()
    check_config(cfg, ctx.world_size, mode, accumulate)
    model = build_model(cfg)
    if mode == "bucketed":
        model = DataParallel(model, bucket_mb=bucket_mb, overlap=overlap)
    replica = model.module if mode == "bucketed" else model
    optimizer = build_optimizer(model.parameters(), cfg)
    ctx.memory.watch(model=model, optimizer=optimizer)
    losses, step_wall = [], []
    for step in range(cfg.steps):
        with ctx.step(step, cfg.steps):
            started = time.perf_counter()
            x, y = batch(replica, cfg, step)  # the global batch; keep my slice of it
            x = data.shard(x, ctx.rank, ctx.world_size)
            y = data.shard(y, ctx.rank, ctx.world_size)
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            with ctx.memory.track_activations():
                for k, (mx, my) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
                    last = k == accumulate - 1
                    # inner micro-batches accumulate locally; the last one synchronises
                    quiet = model.no_sync() if mode == "bucketed" and not last else nullcontext()
                    which = "" if accumulate == 1 else f" (micro-batch {k})"
                    with quiet:
                        with ctx.clock.compute("forward" + which):
                            # scaled so the K micro-gradients add up to the shard's mean gradient
                            loss = model(mx, my) / accumulate
                        with ctx.clock.compute("backward" + which):  # bucket hooks fire here
                            loss.backward()
                    loss_sum += loss.item()
            if mode == "naive":
                average_gradients(model.parameters(), per_tensor=True, tag="grad")
            else:   # already done at the end of backward; kept to show where it happens
                model.finish_gradient_synchronization()
            with ctx.clock.compute("optimizer step"):
                optimizer.step()
            losses.append(loss_sum)
            step_wall.append(time.perf_counter() - started)
    return rank_result(ctx, losses, params=full_params(replica) if ctx.rank == 0 else None,
                       local_loss=losses, step_wall_s=step_wall)


def gradient_bytes(cfg):
    """Bytes of one full set of gradients (what every rank all-reduces per step)."""
    model = build_model(cfg)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def predicted_wire_bytes(grad_bytes, world_size, steps=1):
    """Ring all-reduce: each rank sends 2(N-1)/N x gradient bytes per step."""
    return ring_all_reduce_bytes(grad_bytes, world_size, steps)


# ---------------------------------------------------------------------- a ring from send/recv

def ring_all_reduce(ctx, tensor, group=None, op="sum"):
    """Sum (or average) `tensor` over the group in place, with only send and recv.

    Cut the tensor into N chunks. Reduce-scatter: in step s (of N-1) member r sends chunk
    (r - s) mod N to its right neighbour and adds what its left neighbour sends into chunk
    (r - s - 1) mod N; afterwards member r owns the full sum of chunk (r + 1) mod N. All-gather:
    N-1 more steps pass the finished chunks around the ring. Each rank sent 2(N-1) chunks of
    S/N bytes: 2(N-1)/N x S. Sends are async (post the send, then receive, then wait): if every
    rank first waited in recv, nobody would ever send. Neighbours are ranks of the group.
    """
    g = ctx.group(group)
    n, r = g.size, g.rank
    if n == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    chunks = list(torch.tensor_split(flat, n))
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):                        # reduce-scatter
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        tag = f"ring reduce-scatter step {s}"
        handle = ctx.comm.send(chunks[send_i], right, group=g, async_op=True, tag=tag)
        ctx.comm.recv(incoming, left, group=g, tag=tag)
        handle.wait()
        chunks[recv_i].add_(incoming)
    for s in range(n - 1):                        # all-gather
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        tag = f"ring all-gather step {s}"
        handle = ctx.comm.send(chunks[send_i], right, group=g, async_op=True, tag=tag)
        ctx.comm.recv(chunks[recv_i], left, group=g, tag=tag)
        handle.wait()
    if op == "avg":
        flat.div_(n)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


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
                        help="bucketed (DataParallel: DDP-style, async) or naive (one "
                             "all-reduce per tensor after backward)")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB,
                        help="gradient bucket size in MB (1e6 bytes)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="start the bucket all-reduces after backward, not during it")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per step (gradient accumulation, one sync)")


def predict_memory(cfg, world_size, mode="bucketed", accumulate=1):
    """Bytes per rank (theory/): a full replica of params, grads and Adam state on every rank,
    activations for global_batch / (N x K) examples, plus one flat copy of the gradients as
    buckets in bucketed mode. `peak` adds them all (an upper bound)."""
    model = build_model(cfg)
    out = single_device_memory(cfg, model)
    out["activations"] = activation_bytes(model, cfg.global_batch // (world_size * accumulate))
    out["buffers"] = gradient_bytes(cfg) if mode == "bucketed" else 0
    out["peak"] = sum(out[k] for k in ("params", "grads", "optimizer", "activations", "buffers"))
    return out


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", bucket_mb=DEFAULT_BUCKET_MB,
           no_overlap=False, accumulate=1, mode="bucketed", **_):
    """Run data-parallel training and return the run report of DESIGN.md."""
    from ..runtime.launch import launch
    cfg = cfg or RunConfig()
    check_config(cfg, world_size, mode, accumulate)
    results = launch(train, world_size, cfg, mode=mode, bucket_mb=bucket_mb,
                     overlap=not no_overlap, accumulate=accumulate, cluster=cluster)
    loss = global_loss(results)
    results[0] = dict(results[0], loss=loss)
    grad_bytes = gradient_bytes(cfg)
    return build_report(
        "dp", cfg, results, reference=reference_train(cfg), exact=float64_reference(cfg),
        config=dict(mode=mode, bucket_mb=bucket_mb, overlap=not no_overlap,
                    accumulate=accumulate, gradient_bytes=grad_bytes),
        predicted_memory=predict_memory(cfg, world_size, mode, accumulate),
        predicted_comm_bytes_per_rank=predicted_wire_bytes(grad_bytes, world_size, cfg.steps))
