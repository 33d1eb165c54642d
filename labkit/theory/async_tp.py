"""Async TP's per-chunk schedule, modelled: when each chunk multiplies and when each one travels.

The all-gather matmul of a sequence-parallel colwise layer (labkit.parallel.async_tp; "collective
matmul", Wang et al. 2023, ASPLOS) on t ranks: b*s tokens, each rank holding s/t of them.
- plain: all-gather the input ((t-1) ring steps of one chunk), then the whole matmul;
- async: t chunk matmuls of C = 2 (b s / t) h_in (h_out / t) FLOPs / F each (F the in-step
  GEMM rate, step_rate.compute_rate); the chunk for step k+1 travels (S = alpha + chunk bytes /
  bandwidth) while step k multiplies.
Step k+1 starts when both its chunk has arrived and step k is done, so the exposed time is
max(0, S - C) per step after the first (the first chunk is this rank's own): the message hides
completely once C >= S. The reduce-scatter after a rowwise matmul is the same ring run backward
(its chunk sums travel while the next chunk multiplies), with the same schedule.
All times are *modelled* (the alpha-beta link model and the in-step GEMM rate of theory.time,
the run clock's rate).
"""
from . import hardware
from .step_rate import compute_rate
from .time import collective_time, send_time

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


def chunk_schedule(compute_s, send_s, tp) -> dict:
    """The async ring's steps for chunk matmuls of `compute_s` and messages of `send_s` seconds:
    {"steps": [{"chunk", "compute": (start, end), "send": (start, end) or None}], "total_s",
    "plain_s" (gather first, then compute), "comm_s", "exposed_s", "hidden_s"}."""
    steps, arrived, done = [], 0.0, 0.0
    for k in range(tp):
        start = max(done, arrived)          # its chunk is here and the last one is multiplied
        send = (arrived, arrived + send_s) if k < tp - 1 else None
        done = start + compute_s
        steps.append(dict(chunk=k, compute=(start, done), send=send))
        if send is not None:
            arrived = send[1]
    comm = (tp - 1) * send_s
    exposed = done - tp * compute_s
    return dict(steps=steps, total_s=done, plain_s=comm + tp * compute_s, comm_s=comm,
                exposed_s=exposed, hidden_s=comm - exposed)


def all_gather_matmul(tokens, in_features, out_features, tp, *, cluster="8xH100-NVLink",
                      dtype="bf16") -> dict:
    """chunk_schedule of one colwise layer with SP: `tokens` = b*s of the micro-batch, the
    weight h_out x h_in split by output features over `tp` GPUs of `cluster`'s NVLink node;
    adds compute_s and send_s per chunk and the plain all-gather's own time (the same bytes)."""
    c = hardware.cluster(cluster)
    if tokens % tp or out_features % tp:
        raise ValueError(f"tp={tp} must divide the tokens ({tokens}) and the output features "
                         f"({out_features})")
    link = c.link_for(range(tp))
    chunk_tokens = tokens // tp
    chunk_bytes = chunk_tokens * in_features * BYTES[dtype]
    flops = 2 * chunk_tokens * in_features * (out_features // tp)
    compute_s = flops / compute_rate(c.gpu, dtype)
    send_s = send_time(chunk_bytes, link)
    out = chunk_schedule(compute_s, send_s, tp)
    out.update(compute_s=compute_s, send_s=send_s, chunk_bytes=chunk_bytes, link=link.name,
               gpu=c.gpu.name, all_gather_s=collective_time("all_gather", chunk_bytes, tp, link))
    return out


def break_even_tokens(in_features, out_features, tp, *, cluster="8xH100-NVLink", dtype="bf16",
                      mfu=None):
    """Tokens per micro-batch (b*s) at which one chunk's matmul takes as long as its message:
    2 (T/t) h_in (h_out/t) / F = alpha + (T/t) h_in e / B, with F = the in-step GEMM rate, B the
    link's effective bandwidth and e bytes per value, so
        T* = t alpha / (h_in (2 h_out / (t F) - e / B));
    above it async TP hides the whole all-gather. inf if the matmul never keeps up (a chunk's
    FLOPs per byte below the link's F / B). A given `mfu` takes F = mfu x peak instead, the
    constant-MFU rule (lesson 03's exercise states it), a comparison."""
    c = hardware.cluster(cluster)
    link = c.link_for(range(tp))
    flops_per_s = compute_rate(c.gpu, dtype, mfu)
    per_token = in_features * (2 * out_features / tp / flops_per_s
                               - BYTES[dtype] / link.effective_bandwidth)
    return tp * link.latency / per_token if per_token > 0 else float("inf")
