"""Context-parallel formulas: comm bytes per rank, activation memory, causal work per rank, and
the ring's modelled schedule (with and without overlap) as data a Gantt chart can draw.

Ring Attention (Liu et al. 2023, arXiv 2310.01889): each of N ranks holds s/N tokens; K and V
blocks (KV = 2 b h_kv (s/N) d values) travel N-1 hops forward and N-1 backward, the dK, dV
partial sums N hops. The transfer hides under the block computation when the block is large:
a (s/N)^2 block costs 4 b h (s/N)^2 d FLOPs forward against 2 b h_kv (s/N) d values sent.
Causal load balance: contiguous chunks give rank r the work of r + 1/2 blocks (the last rank
~2x the average); zigzag (chunks r and 2N-1-r of 2N, as Llama 3, arXiv 2407.21783) gives
every rank N/2 (Striped Attention, Brandon et al. 2023, arXiv 2311.09431, balances by dealing
tokens round-robin). Llama 3 all-gathers K and V instead of passing them around a ring.
DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509) all-to-alls q, k, v to head shards and
the output back: (N-1)/N (2h + 2h_kv) b (s/N) d values per rank each way, falling as 1/N
(ring and all-gather stay ~2 b h_kv s d whatever N), but N can be at most h_kv.
"""
from __future__ import annotations

from . import hardware
from .memory import model_state_bytes
from .step_rate import compute_rate
from .time import collective_time, wire_bytes_per_rank

LAYOUTS = ("contiguous", "zigzag")
METHODS = ("ring", "all_gather", "ulysses")
FORWARD_MATMULS = 2     # Q K^T and P V
BACKWARD_MATMULS = 5    # scores again, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q


def kv_block_bytes(batch, kv_heads, seq, head_dim, cp, dtype_bytes=2):
    """Bytes of one rank's K and V shard: 2 b h_kv (s/cp) d values."""
    return 2 * batch * kv_heads * seq / cp * head_dim * dtype_bytes


def comm_bytes_per_rank(batch, heads, seq, head_dim, cp, *, dtype_bytes=2, grad_bytes=4,
                        method="ring", kv_heads=None):
    """Bytes one rank sends for one attention call, forward and backward (wire, ring model).

    ring: forward (N-1) KV; backward (N-1) KV + N dKV in `grad_bytes` (labkit keeps the
    travelling partial sums in fp32). all_gather: (N-1) KV forward (all-gather), (N-1) KV
    backward (reduce-scatter of dK, dV in the input dtype). ulysses: all-to-all of q, k, v and
    of the output, (N-1)/N of each shard, forward; the same of their gradients backward.
    """
    n = cp
    kv = kv_block_bytes(batch, kv_heads or heads, seq, head_dim, cp, dtype_bytes)
    if n == 1:
        return dict(forward=0.0, backward=0.0, total=0.0)
    if method == "ring":
        fwd, bwd = (n - 1) * kv, (n - 1) * kv + n * kv * grad_bytes / dtype_bytes
    elif method == "all_gather":
        fwd = bwd = (n - 1) * kv
    elif method == "ulysses":
        fwd = bwd = (n - 1) / n * batch * seq / cp * head_dim * dtype_bytes * (
            2 * heads + 2 * (kv_heads or heads))
    else:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    return dict(forward=fwd, backward=bwd, total=fwd + bwd)


def tiny_gpt_comm_bytes_per_rank(*, layers, batch, heads, seq, head_dim, params, cp, steps,
                                 method="ring"):
    """Wire bytes per rank of a CP training run of a GPT in fp32: per step and layer one
    attention forward and backward (`comm_bytes_per_rank`), and one all-reduce of the
    replicated weights' gradients (4 bytes x `params`)."""
    attention = comm_bytes_per_rank(batch, heads, seq, head_dim, cp, dtype_bytes=4,
                                    grad_bytes=4, method=method)["total"]
    grads = wire_bytes_per_rank("all_reduce", 4 * params, cp)
    return steps * (layers * attention + grads)


def attention_call_prediction(batch, heads, seq, head_dim, cp, layout="zigzag", causal=True,
                              method="ring") -> dict:
    """One fp32 CP attention call of `method`, forward and backward, per rank: wire bytes,
    matmul FLOPs and the bytes saved for backward."""
    shape = (batch, heads, seq, head_dim, cp)
    return dict(
        predicted_flops_per_rank=attention_flops_per_rank(*shape, layout, causal, method=method),
        predicted_comm_bytes_per_rank=comm_bytes_per_rank(
            *shape, dtype_bytes=4, grad_bytes=4, method=method)["total"],
        predicted_saved_bytes_per_rank=attention_saved_bytes(*shape, dtype_bytes=4,
                                                             method=method, causal=causal))


def tiny_gpt_memory_per_rank(params, optimizer="adam"):
    """fp32 states of the whole model, replicated on every CP rank; activations not modelled
    here (`attention_saved_bytes` is attention's share)."""
    states = model_state_bytes(params, mixed_precision=False, optimizer=optimizer)
    return dict(params=states["params"], grads=states["grads"], optimizer=states["optimizer"],
                activations=None, peak=None)


def attention_saved_bytes(batch, heads, seq, head_dim, cp, dtype_bytes=2, method="ring",
                          causal=True):
    """What one rank's attention keeps for backward (K, V with as many heads as Q).

    ring: q, k, v, out of its s/cp tokens and the fp32 log-sum-exp: falls as 1/cp (naive
    attention keeps the b h s^2 probabilities too). all_gather: q, out and lse of its tokens,
    and K, V of the whole sequence. ulysses: q, k, v, out and lse of h/cp heads of the whole
    sequence (as many values as ring's). The last two hand a causal mask to the CPU attention
    kernel, which keeps it as an additive float mask of (queries x keys) in the input dtype."""
    local = batch * heads * seq / cp       # (token, head) rows per rank, for every method
    lse = 4 * local
    if method == "ring":
        return 4 * local * head_dim * dtype_bytes + lse
    if method == "all_gather":
        kept = 2 * local * head_dim * dtype_bytes + 2 * batch * heads * seq * head_dim * \
            dtype_bytes + lse
        return kept + (seq / cp * seq * dtype_bytes if causal else 0)
    if method == "ulysses":
        return 4 * local * head_dim * dtype_bytes + lse + (seq * seq * dtype_bytes
                                                            if causal else 0)
    raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")


def causal_work(cp, layout="contiguous"):
    """Each rank's share of the causal attention work (useful query-key pairs; sums to 1).

    contiguous: rank r's queries see blocks 0..r, the last half-hidden: (2r + 1) / N^2.
    zigzag: every rank 1/N."""
    _check_layout(layout)
    if layout == "zigzag":
        return [1.0 / cp] * cp
    return [(2 * r + 1) / cp ** 2 for r in range(cp)]


def computed_blocks(cp, layout="contiguous", causal=True, method="ring"):
    """(s/cp)^2 blocks each rank's attention computes: ring (labkit's, the diagonal block whole,
    masked): contiguous causal r + 1; zigzag causal 1 + (N-1)/2 (half blocks off the diagonal);
    not causal N. all_gather (s/cp queries x s keys) and ulysses (h/cp heads, s x s): N, the
    masked scores computed whole, as torch counts its attention kernels."""
    _check_layout(layout)
    if method != "ring" or not causal:
        return [float(cp)] * cp
    if layout == "zigzag":
        return [1 + (cp - 1) / 2] * cp
    return [float(r + 1) for r in range(cp)]


def attention_flops_per_rank(batch, heads, seq, head_dim, cp, layout="contiguous",
                             causal=True, backward=True, method="ring"):
    """Matmul FLOPs each rank's attention runs: per whole block 2 (s/cp)^2 d b h FLOPs
    per matmul, 2 matmuls forward and 5 backward (FlashAttention-2's backward)."""
    local = seq / cp
    per_matmul = 2 * batch * heads * local * local * head_dim
    matmuls = FORWARD_MATMULS + (BACKWARD_MATMULS if backward else 0)
    return [b * per_matmul * matmuls for b in computed_blocks(cp, layout, causal, method)]


def imbalance(work):
    """max / mean of per-rank work: 1 is balanced; the slowest rank sets the step."""
    return max(work) / (sum(work) / len(work))


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def _step_work(rank, step, cp, layout, causal):
    """Fraction of a whole block rank `rank` computes at ring step `step` (useful pairs)."""
    src = (rank - step) % cp
    if not causal:
        return 1.0
    if src == rank:
        return 0.5
    if layout == "zigzag":
        return 0.5
    return 1.0 if src < rank else 0.0


def ring_schedule(batch, heads, seq, head_dim, cp, layout="contiguous", causal=True, *,
                  kv_heads=None, gpu="H100", link="NVLink 4", mfu=None, dtype_bytes=2,
                  overlap=True):
    """The forward ring of one attention layer as events {rank, lane, kind, name, start, end}
    (modelled seconds; what labkit.viz.gantt draws), and the layer's time.

    Each step a rank computes its (useful part of the) block at the in-step GEMM rate
    (step_rate.compute_rate, the run clock's; a given `mfu`: the constant-MFU rule mfu x
    peak, for comparison) and sends the KV
    block on; the next step starts when both its block arrived (the slowest neighbour's send)
    and its own compute ended. overlap=False sends after computing (no overlap)."""
    ln = hardware.link(link)
    rate = compute_rate(gpu, "bf16", mfu)
    local = seq / cp
    block_s = FORWARD_MATMULS * 2 * batch * heads * local * local * head_dim / rate
    send_s = collective_time("send", kv_block_bytes(batch, kv_heads or heads, seq, head_dim,
                                                    cp, dtype_bytes), 2, ln) if cp > 1 else 0.0
    events, ready = [], [0.0] * cp     # ready[r]: when rank r may start its next step
    for step in range(cp):
        ends = []
        for r in range(cp):
            start = ready[r]
            work = _step_work(r, step, cp, layout, causal) * block_s
            if work:
                events.append(dict(rank=r, lane="compute", kind="compute",
                                   name=f"forward: block of rank {(r - step) % cp}", start=start,
                                   end=start + work))
            last = step == cp - 1
            send_start = start if overlap else start + work
            if not last:
                events.append(dict(rank=r, lane="comm", kind="send", name="send KV",
                                   start=send_start, end=send_start + send_s))
            ends.append((start + work, send_start + (0.0 if last else send_s)))
        for r in range(cp):   # my next block is the one my left neighbour just sent
            compute_end, _ = ends[r]
            _, arrival = ends[(r - 1) % cp]
            if compute_end < arrival and step < cp - 1:
                events.append(dict(rank=r, lane="compute", kind="idle",
                                   name="wait for KV", start=compute_end, end=arrival))
            ready[r] = max(compute_end, arrival) if step < cp - 1 else compute_end
    return dict(events=events, time_s=max(ready), block_s=block_s, send_s=send_s,
                busy_s=[sum(e["end"] - e["start"] for e in events
                            if e["rank"] == r and e["kind"] == "compute") for r in range(cp)])


def min_block_tokens(heads, head_dim, *, kv_heads=None, gpu="H100", link="NVLink 4", mfu=None,
                     dtype_bytes=2, causal_fraction=0.5):
    """Tokens per rank from which one block's computation hides its KV transfer (bandwidth
    term only): 4 L^2 d h f / F >= 2 L d h_kv bytes / B  ->  L >= h_kv bytes F / (2 h f B),
    F the in-step GEMM rate (ring_schedule's)."""
    ln = hardware.link(link)
    rate = compute_rate(gpu, "bf16", mfu)
    return (kv_heads or heads) * dtype_bytes * rate / (2 * heads * causal_fraction
                                                       * ln.effective_bandwidth)
