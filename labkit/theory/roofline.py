"""The roofline of each technique: when can its communication hide under its compute?

A step's compute takes F / (mfu x peak) and its communication, on one link, bytes / bandwidth
(the bandwidth term of the alpha-beta model: large messages). The communication can hide under
the compute (given overlap) only if the compute is the longer: if the step's **arithmetic
intensity** I = FLOPs / bytes sent per GPU reaches the **ridge** peak x mfu / bandwidth (FLOPs
the GPU does while the link moves one byte). Below the ridge the step is communication-bound
whatever the overlap. (The "network roofline" of Austin et al. 2025, "How to Scale Your
Model"; roofline: Williams, Waterman & Patterson 2009.)

Per GPU and step, with B tokens per GPU, N matmul parameters, e bytes per value, n GPUs:
  compute 6 N B (forward 2, backward 4 FLOPs per weight per token; Kaplan et al. 2020);
  DP (DDP): all-reduce of the gradients, 2 (n-1)/n N e bytes  -> I = 3 B n / ((n-1) e);
  FSDP / ZeRO-3: all-gather forward and backward, reduce-scatter the gradients,
      3 (n-1)/n N e bytes (Rajbhandari et al. 2020)          -> I = 2 B n / ((n-1) e);
  TP (Megatron, Shoeybi et al. 2019), per layer of h-wide activations and P_layer matmul
      weights over t GPUs: 6 P_layer B / t FLOPs against 4 all-reduces of B h e bytes
      (2 forward, 2 backward), 2 (t-1)/t each                 -> I = 3 P_layer / (4 h e (t-1)):
      no B in it: a larger batch does not help TP, only a faster link or a smaller t.
So DP and FSDP hide behind a large enough batch per GPU, B* = ridge x e (n-1)/n x {2/3, 1}.
"""
from __future__ import annotations

from . import hardware
from .time import wire_bytes_per_rank

TECHNIQUES = ("dp", "fsdp", "tp")
FLOPS_PER_PARAM_TOKEN = 6          # forward 2 + backward 4


def step_flops(params, tokens):
    """Training FLOPs of `tokens` tokens through `params` matmul weights: 6 N B."""
    return FLOPS_PER_PARAM_TOKEN * params * tokens


def comm_bytes_per_gpu(technique, params, gpus, dtype_bytes=2, *, tokens=None, hidden=None,
                       layers=1):
    """Bytes one GPU sends per step (ring model, theory.time.wire_bytes_per_rank).

    dp: all-reduce of the gradients; fsdp: two all-gathers of the weights and a
    reduce-scatter of the gradients; tp: per layer 4 all-reduces of the (tokens x hidden)
    activations (needs tokens, hidden; `params` then counts the weights of those layers)."""
    _check(technique)
    n, size = gpus, params * dtype_bytes
    if technique == "dp":
        return wire_bytes_per_rank("all_reduce", size, n)
    if technique == "fsdp":
        shard = size / n            # all_gather's input is this GPU's shard
        return 2 * wire_bytes_per_rank("all_gather", shard, n) + wire_bytes_per_rank(
            "reduce_scatter", size, n)
    if tokens is None or hidden is None:
        raise ValueError("tp's bytes need tokens= and hidden= (the activations it all-reduces)")
    return layers * 4 * wire_bytes_per_rank("all_reduce", tokens * hidden * dtype_bytes, n)


def intensity(technique, tokens_per_gpu, params, gpus, dtype_bytes=2, *, hidden=None,
              layers=1):
    """FLOPs per byte sent over the link, per GPU and step (for tp: `params` are the matmul
    weights of `layers` layers, split over the `gpus` of the TP group)."""
    share = gpus if technique == "tp" else 1
    flops = step_flops(params, tokens_per_gpu) / share
    sent = comm_bytes_per_gpu(technique, params, gpus, dtype_bytes, tokens=tokens_per_gpu,
                              hidden=hidden, layers=layers)
    return flops / sent if sent else float("inf")


def ridge(gpu="H100", link="NVLink 4", dtype="bf16", mfu=1.0, effective=True):
    """FLOPs the GPU does (at mfu x peak) while the link moves one byte: the intensity at
    which compute and communication take equally long. effective=False: the line rate."""
    g, ln = hardware.gpu(gpu), hardware.link(link)
    bandwidth = ln.effective_bandwidth if effective else ln.bandwidth
    return g.flops(dtype) * mfu / bandwidth


def critical_batch(technique, gpus, gpu="H100", link="NVLink 4", dtype_bytes=2, mfu=1.0,
                   effective=True):
    """The smallest tokens per GPU at which the step's intensity reaches the ridge (DP, FSDP):
    B* = ridge x bytes per parameter / 6. TP has none (its intensity does not depend on B):
    see `tp_max_degree`."""
    _check(technique)
    if technique == "tp":
        raise ValueError("tp's intensity does not grow with the batch: use tp_max_degree")
    bytes_per_param = comm_bytes_per_gpu(technique, 1, gpus, dtype_bytes)
    if bytes_per_param == 0:
        return 0.0
    return ridge(gpu, link, mfu=mfu, effective=effective) * bytes_per_param \
        / FLOPS_PER_PARAM_TOKEN


def tp_intensity(hidden, layer_params, tp, dtype_bytes=2):
    """TP's FLOPs per byte for one layer: 3 P_layer / (4 h e (t-1)), whatever the batch."""
    return intensity("tp", 1, layer_params, tp, dtype_bytes, hidden=hidden)


def tp_max_degree(hidden, layer_params, gpu="H100", link="NVLink 4", dtype_bytes=2, mfu=1.0):
    """The largest TP degree t whose per-layer intensity still reaches the ridge (1: none)."""
    line = ridge(gpu, link, mfu=mfu)
    t = 1
    while tp_intensity(hidden, layer_params, t + 1, dtype_bytes) >= line:
        t += 1
    return t


def times(technique, tokens_per_gpu, params, gpus, gpu="H100", link="NVLink 4", dtype_bytes=2,
          mfu=1.0, *, hidden=None, layers=1):
    """(compute seconds, communication seconds) of one step per GPU, bandwidth term only."""
    g, ln = hardware.gpu(gpu), hardware.link(link)
    share = gpus if technique == "tp" else 1
    compute = step_flops(params, tokens_per_gpu) / share / (g.flops("bf16") * mfu)
    sent = comm_bytes_per_gpu(technique, params, gpus, dtype_bytes, tokens=tokens_per_gpu,
                              hidden=hidden, layers=layers)
    return compute, sent / ln.effective_bandwidth


def _check(technique):
    if technique not in TECHNIQUES:
        raise ValueError(f"technique must be one of {', '.join(TECHNIQUES)}, got {technique!r}")


# ------------------------------------------------------------ alpha and beta from measurements

def fit_alpha_beta(sizes, seconds, group_size, op="all_reduce"):
    """Fit the alpha-beta model t = steps x alpha + wire bytes / beta (theory.time's ring
    costs) to measured (bytes, seconds) pairs, by least squares on the relative error (so the
    small, latency-bound messages count as much as the large ones). Returns (alpha seconds,
    beta bytes/s)."""
    import numpy as np
    from .time import ring_steps
    sizes, seconds = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    if len(sizes) < 2 or len(sizes) != len(seconds):
        raise ValueError("need at least two (size, seconds) pairs of the same length")
    steps = ring_steps(op, group_size)
    wire = np.array([wire_bytes_per_rank(op, s, group_size) for s in sizes])
    design = np.stack([np.full_like(wire, steps), wire], axis=1) / seconds[:, None]
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    return float(alpha), float(1 / inverse_beta) if inverse_beta > 0 else float("inf")


def half_latency_bytes(alpha, beta, group_size, op="all_reduce"):
    """The message size at which latency and bandwidth cost the same (Hockney's n_1/2): a
    gradient bucket several times larger spends little on latency, one much larger leaves
    less to overlap (PyTorch DDP's default bucket: 25 MB)."""
    from .time import ring_steps
    per_byte = wire_bytes_per_rank(op, 1.0, group_size)
    return ring_steps(op, group_size) * alpha * beta / per_byte
