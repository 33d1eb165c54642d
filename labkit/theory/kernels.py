"""A layer's time as the sum of its kernels: each the max of its FLOPs at the GEMM efficiency of
its shape and its bytes at an achievable HBM bandwidth, plus a launch cost.

For one kernel (Williams et al. 2009's roofline, kernel by kernel):
    t = max(flops / (peak x ceiling x shape_efficiency), bytes / (hbm_bw x hbm_fraction)) + launch
- ceiling: the maximum achievable matmul FLOP/s over the dense peak (MAMF, stas00/ml-engineering's
  table, data/hardware.csv); a GPU without one gets DEFAULT_MAMF_FRACTION (data/kernels.csv).
- shape_efficiency (NVIDIA, "Matrix Multiplication Background User's Guide", dimension
  quantization): C = M x N is cut into tiles tm x tn (the guide's sizes, data/kernels.csv), one
  tile per SM at a time, so the GPU runs waves = ceil(tiles / SMs) of them and K in steps of
  TILE_K; the useful share of what runs is
      e(tile) = M N K / (waves x SMs x tm x tn x ceil(K / TILE_K) x TILE_K)
  and the library picks the tile with the largest e: 1 for large shapes, less for small or
  ragged ones (M = 1 at batch-1 decode: 1/64). Batched GEMMs (attention) count every
  matrix's tiles.
- fused attention: forward and backward each at their own measured TFLOP/s for the GPU, head
  dim and sequence length (attention_rate: FlashAttention-3's paper's curves of the cuDNN
  kernel on H100, data/kernels.csv, interpolated in log2 of the length), times the tile
  efficiency of the shape; a GPU without a curve gets DEFAULT_ATTENTION_FRACTION of its peak.
- bytes: what a kernel reads and writes in HBM (a GEMM: A, B and C once), at HBM_FRACTION of the
  datasheet bandwidth (sustained inside a model's kernels, data/kernels.csv).
- launch: LAUNCH_S per kernel (the middle of a measured range, data/kernels.csv), so a batch-1
  decode of ~200 small kernels takes longer than its bytes alone.
Every constant has one public source in data/kernels.csv but one: IN_STEP_GEMM_FRACTION, the
rate of a GEMM inside a model's step over the microbenchmark's (training_forward, and a serving
pass's linear layers: pricing.linear_layer_rate), fitted on the declared calibration rows
(Narayanan et al. 2021 Table 1: published.fit_in_step_gemm_fraction), none of the check rows
(theory/error_band.py). A measured profile (theory/profile.py)
replaces the peak and the bandwidth with its own (ceiling and hbm_fraction then 1).
No torch here: `plan` stays quick.
"""
from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass

from . import hardware


@functools.lru_cache(maxsize=None)
def constants() -> dict:
    """data/kernels.csv as {name: value text} (each row carries its source)."""
    with (hardware.TABLES / "kernels.csv").open(newline="") as f:
        return {r["name"]: r["value"] for r in csv.DictReader(f)}


def _number(name):
    return float(constants()[name])


TILES = tuple(tuple(int(x) for x in t.split("x")) for t in constants()["tile_shapes"].split())
TILE_K = int(_number("tile_k"))
HBM_FRACTION = _number("hbm_fraction")
LAUNCH_S = _number("launch_s")
DEFAULT_MAMF_FRACTION = _number("default_mamf_fraction")
DEFAULT_ATTENTION_FRACTION = _number("attention_default_fraction")
IN_STEP_GEMM_FRACTION = _number("in_step_gemm_fraction")


@functools.lru_cache(maxsize=None)
def attention_curves() -> dict:
    """{(pass, gpu, head_dim, causal): ((log2 length, TFLOP/s), ...)} from data/kernels.csv's
    'attention forward|backward GPU dD [causal]' rows."""
    out = {}
    for name, value in constants().items():
        if not name.startswith("attention forward ") and not name.startswith("attention backw"):
            continue
        words = name.split()
        causal = words[-1] == "causal"
        words = words[:-1] if causal else words
        points = tuple(sorted((math.log2(float(a)), float(b)) for a, b in (
            pair.split(":") for pair in value.split())))
        out[(words[1], " ".join(words[2:-1]), int(words[-1][1:]), causal)] = points
    return out


def _interpolate(points, x):
    """Piecewise linear in log2 of the length, held flat beyond the measured ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


@functools.lru_cache(maxsize=4096)
def attention_rate(gpu, head_dim, length, causal=True, direction="forward") -> float:
    """Measured FLOP/s of a fused attention kernel (FLOPs it runs: the unmasked half under a
    causal mask) on `gpu` at `head_dim` (the nearest measured one) and sequence `length`.
    Backward under a causal mask: the unmasked backward curve x the forward's causal /
    unmasked ratio at that length (the paper gives no causal backward). An H200 runs the
    H100 SXM's die and kernels: its curves. A GPU without curves: DEFAULT_ATTENTION_FRACTION
    of its dense bf16 peak."""
    g = hardware.gpu(gpu)
    name = g.name.split(" (measured")[0]
    name = "H100 SXM" if name == "H200 SXM" else name
    curves = attention_curves()
    x = math.log2(max(1.0, length))

    def lookup(direction_, causal_):
        dims = [d for (p, n, d, c) in curves if (p, n, c) == (direction_, name, causal_)]
        if not dims:
            return None
        d = min(dims, key=lambda d: (abs(math.log2(d / head_dim)), -d))
        return _interpolate(curves[(direction_, name, d, causal_)], x) * 1e12
    rate = lookup(direction, causal)
    if rate is None and direction == "backward" and causal:
        forward, unmasked = lookup("forward", True), lookup("forward", False)
        back = lookup("backward", False)
        if None not in (forward, unmasked, back):
            rate = back * forward / unmasked
    if rate is None and causal:
        rate = lookup(direction, False)
    if rate is None:
        rate = lookup("forward", causal) or lookup("forward", False)
    return rate if rate is not None else DEFAULT_ATTENTION_FRACTION * g.bf16_flops


# the H100's causal forward at 8K, head dim 128, over its peak: the figure lesson 06 prints
FLASH_FRACTION = attention_rate("H100", 128, 8192) / hardware.gpu("H100").bf16_flops


@dataclass(frozen=True)
class Kernel:
    name: str
    flops: float
    bytes: float
    efficiency: float = 1.0   # shape efficiency of its FLOPs (1 for element-wise kernels)
    launches: int = 1
    backward_bytes: float = 0.0   # an element-wise kernel's backward HBM bytes (elementwise())
    shape: tuple = None   # a GEMM's (m, n, k, batch, groups, value_bytes): backward() reads it
    backward_efficiency: float = None   # fused attention's backward (its own measured rate)


def sms(gpu) -> int:
    """Streaming multiprocessors of a GPU (data/kernels.csv; a measured GPU keeps its base's
    count, a custom one the stated default)."""
    name = hardware.gpu(gpu).name.split(" (measured")[0]
    return int(float(constants().get(f"sms {name}", constants()["sms default"])))


def ceiling(gpu, precision="bf16") -> float:
    """Fraction of the dense peak the best large GEMM reaches: MAMF / peak (fp8: its own MAMF
    if measured, else the bf16 fraction), DEFAULT_MAMF_FRACTION without a measurement."""
    g = hardware.gpu(gpu)
    if precision == "fp8" and g.mamf_fp8_flops and g.fp8_flops:
        return min(1.0, g.mamf_fp8_flops / g.fp8_flops)
    if g.mamf_bf16_flops:
        return min(1.0, g.mamf_bf16_flops / g.bf16_flops)
    return DEFAULT_MAMF_FRACTION


def hbm_bandwidth(gpu) -> float:
    """Achievable HBM bytes/s: the datasheet's x HBM_FRACTION, or a measured profile's own."""
    g = hardware.gpu(gpu)
    return g.memory_bw * (g.hbm_fraction if g.hbm_fraction is not None else HBM_FRACTION)


def tile_efficiency(m, n, k, sm_count, tile, batch=1) -> float:
    """Useful share of the work one tile size runs for `batch` GEMMs of M x N x K (above)."""
    tm, tn = tile
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / sm_count)
    k_run = math.ceil(k / TILE_K) * TILE_K
    return batch * m * n * k / (waves * sm_count * tm * tn * k_run)


@functools.lru_cache(maxsize=65536)
def shape_efficiency(m, n, k, sm_count, batch=1) -> float:
    """The best tile's efficiency (cuBLAS picks the fastest tile): in (0, 1]."""
    if min(m, n, k, batch) <= 0:
        raise ValueError(f"GEMM dimensions must be positive, got m={m} n={n} k={k} "
                         f"batch={batch}")
    return max(tile_efficiency(m, n, k, sm_count, t, batch) for t in TILES)


def gemm(name, m, n, k, gpu, batch=1, value_bytes=2, groups=1) -> Kernel:
    """`batch` GEMMs (M x K) @ (K x N) run as one kernel; `groups` such kernels (grouped
    experts) counted as one launch. Bytes: A, B and C once each."""
    m, n, k = max(1, round(m)), max(1, round(n)), max(1, round(k))
    flops = 2 * m * n * k * batch * groups
    moved = value_bytes * (m * k + k * n + m * n) * batch * groups
    return Kernel(name, flops, moved, shape_efficiency(m, n, k, sms(gpu), batch),
                  shape=(m, n, k, batch, groups, value_bytes))


def backward(kern: Kernel, gpu) -> list:
    """A forward kernel's backward kernels. A GEMM Y = X W (M x K @ K x N) has two, each with
    the forward's FLOPs but its own shape, so its own tile and wave quantization (NVIDIA's
    "Linear/Fully-Connected Layers User's Guide", forward / activation gradient / weight
    gradient): dgrad dX = dY W^T (M x N @ N x K: m, n, k -> m, k, n) and wgrad dW = X^T dY
    (K x M @ M x N: -> k, n, m; the token count is its inner dimension). FlashAttention's
    backward is one kernel of 2.5 x the forward's FLOPs (it recomputes the scores: 5 matmuls
    for the forward's 2; the `flops(mode="bwd")` of Dao-AILab/flash-attention's
    benchmarks/benchmark_flash_attention.py), reading Q, K, V, O, dO and writing dQ, dK, dV
    (about twice the forward's bytes), at its own measured efficiency (attention_rate)."""
    if kern.shape is None:
        eff = kern.efficiency if kern.backward_efficiency is None else kern.backward_efficiency
        return [Kernel(kern.name + " backward", 2.5 * kern.flops, 2 * kern.bytes, eff,
                       kern.launches)]
    m, n, k, batch, groups, value_bytes = kern.shape
    return [gemm(kern.name + " dgrad", m, k, n, gpu, batch, value_bytes, groups),
            gemm(kern.name + " wgrad", k, n, m, gpu, batch, value_bytes, groups)]


def elementwise(name, nbytes, inputs=1, linear=False, backward=None) -> Kernel:
    """A memory-bound kernel moving `nbytes` forward: `inputs` tensors read, one as large
    written. Its backward reads the output's gradient and the saved inputs and writes the
    inputs' gradients, (2 inputs + 1) / (inputs + 1) of the forward bytes; a linear map
    (`linear`: rotary embedding, a residual add, a permutation) maps the gradient back with the
    forward's bytes; `backward` states other bytes outright."""
    if backward is None:
        backward = nbytes if linear else nbytes * (2 * inputs + 1) / (inputs + 1)
    return Kernel(name, 0.0, nbytes, backward_bytes=backward)


def kernel_time(kern: Kernel, flops_rate, bandwidth, launch=LAUNCH_S) -> float:
    """max(flops / (rate x shape efficiency), bytes / bandwidth) + launches x launch."""
    compute = kern.flops / (flops_rate * kern.efficiency) if kern.flops else 0.0
    return max(compute, kern.bytes / bandwidth) + kern.launches * launch


def layer_kernels(m, tokens, seq_kv, gpu, *, tp=1, ep=1, sequences=1, causal=True,
                  flash=True, value_bytes=2, sp=False, dropout=False, ring=1):
    """One transformer layer's forward kernels on one GPU for `tokens` query tokens of
    `sequences` sequences, each attending to `seq_kv` keys (training: seq_kv = seq; decode:
    the context). Matmuls split by tp (heads, ffn), experts by ep. Element-wise kernels read
    their inputs and write their output once (a = value_bytes x tokens x hidden):
        norm 2a, residual add 3a, rotary 2 x (q + k), activation (gate + up + out) or (in +
        out) x tokens x ffn / tp, unfused softmax 2 x the scores, MoE permutes 2a x top_k.
    Sequence parallelism (`sp`, Korthikanti et al. 2022) splits the norms and residual adds
    by tp; without it every TP rank runs them on all tokens. `dropout` (GPT models, Megatron's
    fused bias-dropout-add and its attention dropout, Korthikanti et al. 2022 section 4.1)
    writes a 1-byte mask per element beside each residual branch's output and, unfused, beside
    the dropped-out probabilities (FlashAttention regenerates its mask in the kernel).
    Each element-wise kernel also carries its backward bytes (elementwise()). `ring`: context
    parallelism's ring (Liu et al. 2023) runs attention as `ring` launches, one per K/V block
    of seq_kv / ring keys, each its own smaller GEMM shape."""
    h, d, f = m.hidden, m.head_dim, m.ffn
    heads = m.heads / tp
    kv = max(1.0, m.kv_heads / tp)
    act = value_bytes * tokens * h
    stream = act / tp if sp else act          # the residual stream this rank's norms touch
    mask = stream / value_bytes if dropout else 0.0
    gpt = m.arch in ("gpt", "gpt2")
    out = [elementwise("norm", 2 * stream),
           gemm("qkv", tokens, (heads + 2 * kv) * d, h, gpu, value_bytes=value_bytes)]
    if not gpt:
        out.append(elementwise("rope", 2 * value_bytes * tokens * (heads + kv) * d,
                               linear=True))
    out += attention_kernels(m, tokens, seq_kv, gpu, tp=tp, sequences=sequences, causal=causal,
                             flash=flash, value_bytes=value_bytes, dropout=dropout, ring=ring)
    out += [gemm("attention output", tokens, h, heads * d, gpu, value_bytes=value_bytes),
            _residual(stream, mask), elementwise("norm", 2 * stream)]
    if m.experts > 1:
        # the group's tokens x top_k picks, spread evenly: tokens x top_k per GPU over its
        # local experts, as many of them busy as there are picks (batch-1 decode: one)
        pairs = tokens * min(m.top_k, m.experts)
        local = max(1, min(m.experts // ep, math.ceil(pairs)))
        per_expert = pairs / local
        out += [gemm("router", tokens, m.experts, h, gpu, value_bytes=value_bytes),
                elementwise("permute", 2 * act * m.top_k, linear=True),
                gemm("experts up/gate", per_expert, 2 * f / tp, h, gpu, groups=local,
                     value_bytes=value_bytes),
                elementwise("activation", 3 * value_bytes * per_expert * local * f / tp,
                            inputs=2),
                gemm("experts down", per_expert, h, f / tp, gpu, groups=local,
                     value_bytes=value_bytes),
                elementwise("unpermute", 2 * act * m.top_k, linear=True)]
    else:
        up = f / tp if gpt else 2 * f / tp
        out += [gemm("mlp up/gate" if not gpt else "mlp up", tokens, up, h, gpu,
                     value_bytes=value_bytes),
                elementwise("activation", value_bytes * tokens * (up + f / tp),
                            inputs=1 if gpt else 2),
                gemm("mlp down", tokens, h, f / tp, gpu, value_bytes=value_bytes)]
    out.append(_residual(stream, mask))
    return out


def attention_kernels(m, tokens, seq_kv, gpu, *, tp=1, sequences=1, causal=True, flash=True,
                      value_bytes=2, dropout=False, ring=1):
    """The attention core of one layer (layer_kernels' arguments): one fused kernel (Q, K, V
    read, O written, at its measured rate) or, unfused, the scores GEMM, the softmax (and
    attention dropout) over the scores in HBM, and the values GEMM."""
    d, heads = m.head_dim, m.heads / tp
    kv = max(1.0, m.kv_heads / tp)
    out = []
    q_len = max(1, round(tokens / sequences))
    # causal: FlashAttention skips the masked blocks (plan_terms.attention_time_factor)
    share = 0.5 if causal and flash and q_len > 1 else 1.0
    groups = max(1, round(sequences * heads))
    block = seq_kv / ring
    scores = gemm("attention scores", q_len, block, d, gpu, batch=groups * ring,
                  value_bytes=value_bytes)
    values = gemm("attention values", q_len, d, block, gpu, batch=groups * ring,
                  value_bytes=value_bytes)
    flops = (scores.flops + values.flops) * share
    qkvo = value_bytes * sequences * (2 * q_len * heads + 2 * seq_kv * kv) * d
    if flash:   # one fused kernel: Q, K, V read, O written; no scores in HBM
        # its measured rate at this length (queries x keys of one launch, geometric mean)
        tiles = min(scores.efficiency, values.efficiency)
        best = hardware.gpu(gpu).bf16_flops * ceiling(gpu)
        length, masked = math.sqrt(q_len * block), share < 1

        def eff(direction):
            return min(1.0, tiles * attention_rate(gpu, d, length, masked, direction) / best)
        out.append(Kernel("flash attention", flops, qkvo, eff("forward"), launches=ring,
                          backward_efficiency=eff("backward")))
    else:       # scores written, softmax reads and writes them, values read them
        s_bytes = value_bytes * groups * q_len * seq_kv * share
        out += [Kernel("attention scores", scores.flops * share, qkvo / 2 + s_bytes,
                       scores.efficiency, shape=scores.shape),
                elementwise("softmax", 2 * s_bytes)]
        if dropout:   # reads the probabilities, writes them dropped and the mask
            drop = 2 * s_bytes + s_bytes / value_bytes
            out.append(elementwise("attention dropout", drop, backward=drop))
        out.append(Kernel("attention values", values.flops * share, qkvo / 2 + s_bytes,
                          values.efficiency, shape=values.shape))
    return out


def _residual(stream, mask):
    """The residual add (3 x the stream: branch and stream read, sum written); its backward is
    the add where the branch's gradient joins the stream's (3 x). With dropout (`mask` bytes,
    fused as Megatron's bias-dropout-add) the forward also writes the mask and the backward
    also reads the gradient and the mask and writes the branch's gradient (2 x + mask)."""
    return elementwise("residual", 3 * stream + mask,
                       backward=3 * stream + (2 * stream + mask if mask else 0.0))


# Bytes per logit of Megatron-Core's vocab-parallel cross entropy (megatron/core/
# tensor_parallel/cross_entropy.py, called on logits.float()), kernel by kernel. Forward: the
# cast to fp32 (read 2, write 4), the max (read 4), subtract it in place (4 + 4), exp in place
# (4 + 4), the sum (read 4), divide in place into the softmax kept for backward (4 + 4): 38.
# Backward: the softmax times the loss's gradient in place (4 + 4), the cast's backward to bf16
# (read 4, write 2): 14. (The target gathers touch one logit per token: left out.)
LOSS_FORWARD_BYTES, LOSS_BACKWARD_BYTES = 38, 14


def head_kernels(m, tokens, gpu, *, tp=1, value_bytes=2, sp=False, loss=False):
    """The final norm (split by tp under sequence parallelism) and the logits GEMM (vocab
    split by tp); in training (`loss`) the cross entropy over the rank's logits."""
    stream = value_bytes * tokens * m.hidden / (tp if sp else 1)
    out = [elementwise("final norm", 2 * stream),
           gemm("logits", tokens, m.vocab / tp, m.hidden, gpu, value_bytes=value_bytes)]
    if loss:
        logits = tokens * m.vocab / tp
        out.append(elementwise("cross entropy", LOSS_FORWARD_BYTES * logits,
                               backward=LOSS_BACKWARD_BYTES * logits))
    return out


def is_gemm(kern: Kernel) -> bool:
    return kern.flops > 0


def forward_time(kernels, flops_rate, bandwidth, launch=LAUNCH_S, only=None) -> float:
    """Sum of kernel_time over `kernels` (optionally those `only(kernel)` selects)."""
    return sum(kernel_time(k, flops_rate, bandwidth, launch) for k in kernels
               if only is None or only(k))


def roofline_time(kernels, flops_rate, bandwidth) -> float:
    """The whole layer as one roofline (no shapes, no launches): max(sum flops / rate, sum
    bytes / bandwidth). The kernel sum is never below it at the same rate and bandwidth."""
    return max(sum(k.flops for k in kernels) / flops_rate,
               sum(k.bytes for k in kernels) / bandwidth)


@functools.lru_cache(maxsize=4096)
def training_forward(m, tokens, seq, gpu, tp, ep, sequences, causal, flash, value_bytes,
                     linear_rate, bf16_rate, launch=LAUNCH_S, sp=False, dropout=False,
                     ring=1, gemm_fraction=IN_STEP_GEMM_FRACTION) -> dict:
    """Seconds of one layer's forward on one GPU for the training planner, by part: the
    linear-layer GEMMs at `linear_rate` (the precision's peak x ceiling), attention and the
    logits at `bf16_rate`, each forward and backward (backward(): dgrad and wgrad at their own
    shapes, FlashAttention's 2.5 x), and the launches of every kernel. Launch costs are not in
    the GEMM parts. Bytes (plan_terms.elementwise_time times them): the layer's element-wise kernels
    forward and backward, the head's (final norm), and `softmax` (the unfused softmax and
    attention dropout forward, what selective recompute runs again). The GEMMs (linear layers
    and logits, not the fused attention, measured on its own) run at `gemm_fraction` of their
    microbenchmark rate: IN_STEP_GEMM_FRACTION, the module docstring's one fitted number."""
    layer = layer_kernels(m, tokens, seq, gpu, tp=tp, ep=ep, sequences=sequences,
                          causal=causal, flash=flash, value_bytes=value_bytes, sp=sp,
                          dropout=dropout, ring=ring)
    bw = hbm_bandwidth(gpu)
    attention = [k for k in layer if k.name.startswith("attention s") or k.name.startswith(
        "attention v") or k.name == "flash attention"]
    linear = [k for k in layer if is_gemm(k) and k not in attention]
    head = head_kernels(m, tokens, gpu, tp=tp, value_bytes=value_bytes, sp=sp, loss=True)
    pointwise = [k for k in layer if not is_gemm(k)]

    def back(kernels_):
        return [b for k in kernels_ for b in backward(k, gpu)]
    head_gemms = [k for k in head if is_gemm(k)]
    linear_rate, head_rate = linear_rate * gemm_fraction, bf16_rate * gemm_fraction
    return dict(gemm=forward_time(linear, linear_rate, bw, 0.0),
                gemm_backward=forward_time(back(linear), linear_rate, bw, 0.0),
                attention=forward_time(attention, bf16_rate, bw, 0.0),
                attention_backward=forward_time(back(attention), bf16_rate, bw, 0.0),
                head=forward_time(head_gemms, head_rate, bw, 0.0),
                head_backward=forward_time(back(head_gemms), head_rate, bw, 0.0),
                launch=sum(k.launches for k in layer) * launch,
                backward_launch=(sum(k.launches for k in back(linear + attention))
                                 + len(pointwise)) * launch,
                head_launch=len(head) * launch,
                forward_bytes=sum(k.bytes for k in pointwise),
                backward_bytes=sum(k.backward_bytes for k in pointwise),
                head_bytes=sum(k.bytes + k.backward_bytes for k in head if not is_gemm(k)),
                softmax_bytes=sum(k.bytes for k in pointwise if k.name in (
                    "softmax", "attention dropout")))
