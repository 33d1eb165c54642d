"""Data parallelism in closed form: the ring all-reduce's bytes and inference throughput.

Training: each rank all-reduces the S gradient bytes (4Ψ in fp32) every step; a ring
(reduce-scatter, then all-gather, N-1 steps of one S/N chunk each) sends 2(N-1)/N x S bytes per
rank (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"). Memory: a whole replica per rank (theory.memory.fp32_rank_bytes), plus S of
gradient buckets.
Inference: independent batches need no communication at all; N replicas multiply throughput
and leave the latency of one batch unchanged.
"""
import math


def gradient_bytes(model):
    """S: the bytes of one full set of `model`'s gradients (what every rank all-reduces per
    step), each trainable parameter's elements times its element size."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def ring_all_reduce_bytes(nbytes, world_size, steps=1):
    """Bytes each rank sends in a ring all-reduce of `nbytes`: 2(N-1)/N x nbytes per step."""
    n = world_size
    return 2 * (n - 1) / n * nbytes * steps


def inference_throughput(batch_latency_s, replicas, batches):
    """Closed form for independent batches on `replicas` copies, each `batch_latency_s` a batch.

    makespan = ceil(batches / replicas) x latency; throughput = batches / makespan; the latency
    of any one batch stays `batch_latency_s`. With fewer batches than replicas some replicas idle.
    """
    rounds = math.ceil(batches / replicas) if batches else 0
    makespan = rounds * batch_latency_s
    busy = batches * batch_latency_s / (replicas * makespan) if makespan else 0.0
    return dict(replicas=replicas, batches=batches, latency_s=batch_latency_s,
                makespan_s=makespan, throughput_per_s=batches / makespan if makespan else 0.0,
                seconds_per_batch=makespan / batches if batches else float("nan"),
                utilisation=busy)
