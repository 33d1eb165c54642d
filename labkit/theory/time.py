"""Closed-form step times: compute at the in-step GEMM rate (step_rate.in_step_gemm_rate, the
planner's and the run clock's one rate), collectives from measured nccl-tests curves where
data/collective_curves.csv has one (theory/collective_curves.py), else alpha-beta.

Without a curve a ring collective over n ranks takes steps * alpha + the busiest rank's bytes /
beta (all-reduce: 2(n-1) steps, 2(n-1)/n * S bytes; broadcast: the root sends all S), beta the
link's bandwidth x its efficiency (data/hardware.csv); training costs 6 FLOPs per
matmul weight per token plus the attention scores (the input embedding is a lookup, no FLOPs);
a pipeline idles (P-1)/(M+P-1).
"""
from __future__ import annotations

import math

from . import catalog, collective_curves, hardware
from .memory import dtype_bytes
from .step_rate import compute_rate
from .transformer import model_flops_per_token

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv",
       "barrier")


def _check_op(op):
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def wire_bytes_per_rank(op, nbytes, group_size) -> float:
    """Ring-model bytes a rank sends, averaged over the group's ranks (modelled, not measured);
    nbytes is the tensor this rank hands the op. Summed over a run, this is each rank's volume.

    all_reduce 2(n-1)/n * S (reduce-scatter then all-gather, Patarasuk & Yuan 2009);
    all_gather (n-1) * S (S is the input shard: (n-1)/n of the gathered output);
    reduce_scatter and all_to_all (n-1)/n * S; broadcast (n-1)/n * S, the average over ranks of a
    pipelined chain in which n-1 ranks each forward S (its time is set by the busiest rank:
    busiest_rank_bytes); send S, recv 0, barrier 0; n == 1 -> 0.
    """
    _check_op(op)
    n = group_size
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op == "all_gather":
        return (n - 1) * nbytes
    if op in ("reduce_scatter", "all_to_all", "broadcast"):
        return (n - 1) / n * nbytes
    if op == "send":
        return float(nbytes)
    return 0.0   # recv, barrier


def busiest_rank_bytes(op, nbytes, group_size) -> float:
    """Bytes the busiest rank sends, which set the op's time. The ring ops are symmetric (every
    rank sends wire_bytes_per_rank); a broadcast's root sends all S, and so does every rank of
    the pipelined chain but the last, so it takes S / bandwidth (nccl-tests' convention: a
    broadcast's bus bandwidth is S / time), not the (n-1)/n * S average."""
    _check_op(op)
    if op == "broadcast" and group_size > 1:
        return float(nbytes)
    return wire_bytes_per_rank(op, nbytes, group_size)


def ring_steps(op, group_size) -> int:
    """Messages in sequence (each paying the latency alpha) for the ring algorithm."""
    _check_op(op)
    n = group_size
    if n <= 1:
        return 0
    if op in ("all_reduce", "barrier"):    # a barrier is modelled as an empty all-reduce
        return 2 * (n - 1)
    if op in ("send", "recv"):
        return 1
    return n - 1


def collective_time(op, nbytes, group_size, link) -> float:
    """Seconds for op: the link's measured nccl-tests curve for op where one exists
    (collective_curves.curve_time: busbw interpolated in log bytes), else alpha-beta:
    steps * link.latency + the busiest rank's bytes / effective bandwidth (Hockney's model;
    ring costs as in Thakur et al. 2005 and NCCL). A recv takes as long as the matching send:
    the receiver waits for the nbytes to arrive."""
    _check_op(op)
    if group_size <= 1:
        return 0.0
    ln = hardware.link(link)
    measured = collective_curves.curve_time(op, nbytes, group_size, ln, ring_steps)
    if measured is not None:
        return measured
    wire = busiest_rank_bytes("send" if op == "recv" else op, nbytes, group_size)
    return ring_steps(op, group_size) * ln.latency + wire / ln.effective_bandwidth


def all_reduce_time(nbytes, n, link) -> float:
    return collective_time("all_reduce", nbytes, n, link)


def all_gather_time(nbytes, n, link) -> float:
    return collective_time("all_gather", nbytes, n, link)


def reduce_scatter_time(nbytes, n, link) -> float:
    return collective_time("reduce_scatter", nbytes, n, link)


def broadcast_time(nbytes, n, link) -> float:
    return collective_time("broadcast", nbytes, n, link)


def all_to_all_time(nbytes, n, link) -> float:
    return collective_time("all_to_all", nbytes, n, link)


def send_time(nbytes, link) -> float:
    return collective_time("send", nbytes, 2, link)


def compute_time(flops, gpu, dtype="bf16", mfu=None) -> float:
    """Seconds for `flops` on one GPU at step_rate.compute_rate(gpu, dtype, mfu): the in-step
    GEMM rate, or with `mfu` given the constant-MFU rule mfu x peak (a comparison)."""
    return flops / compute_rate(gpu, dtype, mfu)


def default_seq(model) -> int:
    """The sequence length a model's step is modelled at when none is given: its context,
    at most 4096 (lesson 03's TP step uses 4096 too)."""
    return min(catalog.model(model).max_seq or 4096, 4096)


def training_flops(params, tokens, *, layers=None, hidden=None, seq=None) -> float:
    """Forward + backward FLOPs (Narayanan et al. 2021, arXiv 2104.04473, without recompute).

    A catalog model (ModelShape or name): transformer.model_flops_per_token(m, seq) * tokens,
    6 FLOPs per matmul weight per token plus the attention scores 12 L h s; the input embedding
    is a lookup and costs none (counting it overstates Llama 3 8B by 6.5%); seq defaults to
    default_seq(model). A parameter count N: 6 * N * tokens (Kaplan et al. 2020 arXiv
    2001.08361), plus 12 * L * h * s * tokens when layers, hidden and seq are given."""
    if not isinstance(params, (int, float)):
        m = catalog.model(params)
        if m.arch == "unet":   # not a transformer: 6 N is all there is to say
            return 6.0 * m.param_count() * tokens
        return float(model_flops_per_token(m, seq or default_seq(m)) * tokens)
    flops = 6 * params * tokens
    if layers is not None and hidden is not None and seq is not None:
        flops += 12 * layers * hidden * seq * tokens
    return float(flops)


def bubble_fraction(stages, microbatches, virtual=1) -> float:
    """Idle share of a pipeline step's total time: (P-1)/(V*M + P-1) (GPipe arXiv 1811.06965;
    interleaved 1F1B with V chunks per rank, Narayanan et al. 2021 arXiv 2104.04473)."""
    p, m, v = stages, microbatches, virtual
    return (p - 1) / (v * m + p - 1)


def bubble_over_ideal(stages, microbatches, virtual=1) -> float:
    """Bubble time divided by the ideal (bubble-free) time: (P-1)/(V*M), Narayanan et al. 2021's
    convention. Not the same number as bubble_fraction: say which one a figure shows."""
    return (stages - 1) / (virtual * microbatches)


def _params(model) -> float:
    if isinstance(model, (int, float)):
        return float(model)
    return float(catalog.model(model).param_count())


def dp_step_time(model, *, gpus, cluster, global_batch_tokens, dtype="bf16", overlap=True,
                 bucket_bytes=25e6, seq=None) -> dict:
    """Modelled data-parallel step time in seconds for a fixed global batch.

    compute = training_flops(model, tokens / gpus, seq=seq) / the in-step GEMM rate
    (step_rate.compute_rate; not the cluster's constant-MFU `mfu`): for a catalog model the
    matmuls and the attention scores (the compute model of lesson 03's TP step), for a bare
    count 6 * N * tokens;
    comm = all-reduce of the N gradients (dtype bytes each, so 2N for bf16) in buckets of
    bucket_bytes over the cluster's link (inter-node once gpus > gpus_per_node), ring alpha-beta.
    Overlap (PyTorch DDP style, Li et al. 2020 arXiv 2006.15704): buckets reduce while backward
    (2/3 of compute) runs, except the last one, which is ready only when backward ends:
    exposed = comm - f * min(comm - last_bucket, backward), f = 1 for overlap=True, 0 for False,
    or a float in [0, 1]. total = compute + exposed. `model` is a ModelShape, name or count.
    """
    n_params = _params(model)
    c = hardware.cluster(cluster)
    if gpus > c.world_size:
        raise ValueError(f"{gpus} GPUs requested but cluster {c.name!r} has {c.world_size}")
    flops_of = n_params if isinstance(model, (int, float)) else model
    compute = training_flops(flops_of, global_batch_tokens / gpus, seq=seq) / compute_rate(
        c.gpu, dtype)
    comm, last_bucket = 0.0, 0.0
    if gpus > 1:
        grad_bytes = n_params * dtype_bytes(dtype)
        buckets = max(1, math.ceil(grad_bytes / bucket_bytes))
        last_bucket = all_reduce_time(grad_bytes / buckets, gpus, c.link_for(range(gpus)))
        comm = buckets * last_bucket
    f = float(overlap)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"overlap must be True, False or a fraction in [0, 1], not {overlap!r}")
    backward = 2 / 3 * compute
    exposed = comm - f * min(comm - last_bucket, backward)
    return {"compute": compute, "comm": comm, "exposed_comm": exposed, "total": compute + exposed}


def dp_speedup(model, gpus_list, cluster, *, global_batch_tokens, **kwargs) -> list[float]:
    """Strong-scaling speedups time(1 GPU) / time(n GPUs) at a fixed global batch.

    `cluster` is one cluster (name or Cluster) big enough for max(gpus_list), or a function
    n -> cluster. Extra keyword arguments go to dp_step_time.
    """
    pick = cluster if callable(cluster) else (lambda n: cluster)
    t1 = dp_step_time(model, gpus=1, cluster=pick(1), global_batch_tokens=global_batch_tokens,
                      **kwargs)["total"]
    return [t1 / dp_step_time(model, gpus=n, cluster=pick(n),
                              global_batch_tokens=global_batch_tokens, **kwargs)["total"]
            for n in gpus_list]
