"""One price list for every modelled second: a serving pass, a training layer, a collective.

Every caller that turns work into modelled time asks this module, so that the same step gets
the same number whoever asks: the serving planner (`serving.serving_time`, lesson 09, `plan
--serve`), the request-stream engine and simulator (`serving_stream.modelled_step_s`, lesson
10, `plan --serve --rate`), the training planner (`kernels.training_forward`, re-exported here
as `training_layer`) and the virtual clock (`collective_time`, `kernel_time`).

A serving pass of ragged requests, pieces = [(new tokens, tokens already cached)], on one GPU
of a tp x pp x ep replica (Williams et al. 2009's roofline, kernel by kernel, kernels.py):
    compute = the stage's layers x (the GEMMs of all new tokens + each piece's attention over
              its cached + new keys) + the head's share, each kernel at peak x MAMF ceiling x
              its shape efficiency (attention at its measured rate; the linear layers x the
              in-step GEMM fraction, at fp8's peak for fp8 weights: linear_layer_rate)
    memory  = (the stage's dense weights + the experts the tokens pick + the pieces' KV cache)
              / the sustained HBM bandwidth
    launch  = the stage's kernels x kernels.LAUNCH_S
    host    = the stage's kernels x the host's enqueue time per kernel (`execution`)
    total   = max(max(compute, memory) + launch, host)            (step_total)
The host queues kernels ahead of the GPU, so it costs time only when it is the slower side: a
stack that replays a CUDA graph (vLLM, SGLang, TensorRT-LLM with graphs) enqueues one graph
a step ("graph", host 0); one that enqueues kernel by kernel ("enqueue": TensorRT-LLM's C++
session without graphs, as its 2023 tables ran) spends ENQUEUE_S per kernel, which makes a
short prefill or a batch-1 decode host-bound.
All constants are data/kernels.csv's, each with its public source, but two fitted ones, each
on its own declared calibration rows: the in-step GEMM fraction (training rows, kernels.py)
and ENQUEUE_S (serving rows of other models, published_serving.fit_enqueue_s).
No torch: `plan` stays quick.
"""
from __future__ import annotations

import functools
from collections import Counter

from . import hardware, kernels
from .memory import dtype_bytes
from .plan_cluster import achievable_fraction
from .step_rate import in_step_gemm_rate
from .time import collective_time  # noqa: F401  (the collectives' price, alpha-beta)
from .weights import layer_param_split, weight_bytes

EXECUTIONS = ("graph", "enqueue")
ENQUEUE_S = float(kernels.constants()["enqueue_s"])

kernel_time = kernels.kernel_time          # one kernel: max(FLOPs, bytes) + launches
training_layer = kernels.training_forward  # one layer's training kernels, by part


def kv_bytes_per_token(m, kv_dtype="bf16") -> float:
    """KV-cache bytes one token adds: layers x 2 x kv_heads x head_dim x bytes."""
    return m.layers * 2 * m.kv_heads * m.head_dim * dtype_bytes(kv_dtype)


@functools.lru_cache(maxsize=1024)
def weight_split(m, weights="bf16", tp=1, pp=1, ep=1):
    """(dense bytes, expert bytes) on one GPU: the experts' matrices at the precision with
    their scales, everything else (attention, embeddings, head, norms, routers) dense."""
    w = weight_bytes(m, weights)
    s = layer_param_split(m)
    per_matrix = (w["matrices"] + w["scales"]) / max(s["matrices"], 1)
    expert_bytes = s["experts"] * per_matrix
    return (w["total"] - expert_bytes) / (tp * pp), expert_bytes / (tp * pp * ep)


@functools.lru_cache(maxsize=4096)
def _dense_part(m, gpu, tokens, tp, ep, linear_rate, head_rate):
    """(seconds, launches) of one layer's kernels but attention for `tokens` new tokens (the
    linear layers at `linear_rate`), and of the head at `head_rate` (the attention kernels are
    priced per piece: _attention_part)."""
    layer = kernels.layer_kernels(m, tokens, 1, gpu, tp=tp, ep=ep, sequences=tokens)
    head = kernels.head_kernels(m, tokens, gpu, tp=tp)
    rest = [k for k in layer if not _is_attention(k)]
    return (sum(k.flops / (linear_rate * k.efficiency) for k in rest),
            sum(k.launches for k in rest),
            sum(k.flops / (head_rate * k.efficiency) for k in head),
            sum(k.launches for k in head))


@functools.lru_cache(maxsize=65536)
def _attention_part(m, gpu, new, cached, count, tp, rate):
    """(seconds, launches) of one layer's attention for `count` pieces of `new` tokens over
    `cached` + `new` keys each."""
    mine = kernels.attention_kernels(m, count * new, cached + new, gpu, tp=tp, sequences=count)
    return (sum(k.flops / (rate * k.efficiency) for k in mine),
            sum(k.launches for k in mine))


def _is_attention(k):
    return k.name == "flash attention" or k.name.startswith("attention s") or \
        k.name.startswith("attention v")


def linear_layer_rate(g, weights="bf16") -> float:
    """FLOP/s of the linear layers' GEMMs: fp8 weights on a GPU with fp8 tensor cores run
    fp8 x fp8 GEMMs (TensorRT-LLM's and vLLM's fp8 W8A8) at the fp8 peak x its MAMF ceiling;
    weight-only formats (int8, int4) dequantise to bf16 and run at bf16's."""
    return in_step_gemm_rate(g, "fp8" if weights == "fp8" and g.fp8_flops else "bf16")


def host_time(kernels_, execution="graph", enqueue_s=None) -> float:
    """Seconds the host takes to enqueue a step of `kernels_` kernels (module docstring)."""
    if execution not in EXECUTIONS:
        raise ValueError(f"execution must be one of {', '.join(EXECUTIONS)}, got {execution!r}")
    return 0.0 if execution == "graph" else kernels_ * (ENQUEUE_S if enqueue_s is None
                                                        else enqueue_s)


def step_total(gpu_s, kernels_, execution="graph", enqueue_s=None) -> float:
    """A step's seconds: the GPU's or the host's, whichever is slower (module docstring)."""
    return max(gpu_s, host_time(kernels_, execution, enqueue_s))


def serving_pass(m, gpu, pieces, *, tp=1, pp=1, ep=1, weights="bf16", kv_dtype="bf16",
                 routed=None, execution="graph", enqueue_s=None) -> dict:
    """Seconds of one forward pass of `pieces` [(new, cached)] through one pipeline stage on
    one GPU (module docstring): {compute, memory, launch, host, kernels, total}. `routed`: the
    tokens of the whole EP group that reach the experts (default the pass's own), for how
    many of this GPU's experts they pick; `execution`: "graph" or "enqueue" (EXECUTIONS)."""
    g = hardware.gpu(gpu)
    rate = g.bf16_flops * achievable_fraction(g)
    linear_rate = linear_layer_rate(g, weights)
    tokens = sum(n for n, _ in pieces)
    layers = m.layers / pp
    dense_s, dense_k, head_s, head_k = _dense_part(m, g, tokens, tp, ep, linear_rate,
                                                   in_step_gemm_rate(g))
    attention_s = attention_k = 0.0
    for (new, cached), count in Counter(pieces).items():
        s, k = _attention_part(m, g, new, cached, count, tp, rate)
        attention_s, attention_k = attention_s + s, attention_k + k
    compute = layers * (dense_s + attention_s) + head_s / pp
    count = layers * (dense_k + attention_k) + head_k / pp
    launch = count * kernels.LAUNCH_S
    dense, experts = weight_split(m, weights, tp, pp, ep)
    touched = 1.0
    if m.experts > 1:       # the experts this GPU holds that the group's tokens pick
        local = m.experts / ep
        picks = routed if routed is not None else tokens
        picked = m.experts * (1 - (1 - m.top_k / m.experts) ** picks)
        touched = min(local, picked) / local
    keys = sum(n + c for n, c in pieces)
    cache = keys * kv_bytes_per_token(m, kv_dtype) / (min(tp, m.kv_heads) * pp)
    memory = (dense + experts * touched + cache) / kernels.hbm_bandwidth(g)
    return dict(compute=compute, memory=memory, launch=launch, kernels=count,
                host=host_time(count, execution, enqueue_s),
                total=step_total(max(compute, memory) + launch, count, execution, enqueue_s))
