"""Will a `run serve` fit here, and end within its time? Answered before any rank starts.

Memory (bytes, a lower bound; float32, kv_heads = heads, the tiny GPT of runs/serve.py):

    per rank  = 4Ψ (every rank builds the whole model before it keeps its part)
              + KV cache  2 · L/pp · B/(replicas·ep) · (P + T - 1) · h/tp · 4
              + attention scores of the prefill  2 · (B/(replicas·ep)/pp) · H/tp · P² · 4
                (causal_attention materialises QKᵀ and its softmax: two P x P per head)
              + a CPU rank's Python + torch + gloo (BYTES_PER_CPU_RANK)
    reference = 4Ψ + its KV cache + 2 · B · H · P² · 4 + the prefill's logits B · P · V · 4
              + the logits it returns B · T · V · 4          (run after the ranks end)
    need      = max(world_size x per rank, reference) <= MemAvailable

Time (seconds, a lower bound for the ranks and again for the reference on one device):

    work  = 2 · N_matmul · B · (P + T - 1)        (2 FLOPs per weight a token passes;
                                                 the last token is never fed back)
          + 4 · L · h · B · (P² + (T-1)·P + T(T-1)/2)
                                                (QKᵀ and AV over the prompt, then the cache)
    moved = T · 4Ψ  +  2 · L · B · h · 4 · ((T-1)·P + T(T-1)/2)
                                                (each decode step reads the weights and the
                                                 whole KV cache so far: decoding is memory-bound)
    time  = work / R  +  moved / W  +  T · L · t_layer  +  L · t_build

R: the FLOP/s of a matmul measured here now, on one thread times the usable CPUs (an upper
bound on what the model's small matmuls reach); t_layer: a one-token forward of one block,
measured (every generated token passes every layer, one after the other, at least this long
each); t_build: building one block, measured (module overhead, plus its weights at the
measured initialisation rate); W: the bytes per second a large copy reads here, measured (on
one thread, times the usable CPUs). A run whose ranks would need more than their launch
timeout is refused: it could only end in a timeout.
FLOP counts: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1 (2N per
token forward, plus the attention's 2·L·n_ctx·d per token for QKᵀ and again for AV).
"""
import math
import time
from functools import lru_cache

import torch

from .. import models
from ..runtime.cpus import BYTES_PER_CPU_RANK, available_memory, usable_cpus
from ..theory import serving as theory
from .preflight import _gb   # GB, or TB past a thousand; safe for huge shapes

BYTES = 4   # float32
SCORE_COPIES = 2   # QKᵀ and its softmax alive at once in models.causal_attention


def parameters(cfg):
    """Ψ of the model `cfg` serves, from its shape alone (no module is built)."""
    c = cfg.gpt_config()
    n = c.param_count()
    if cfg.experts > 1:   # each MoE layer holds `experts` MLPs where the dense GPT has one
        n += (cfg.experts - 1) * c.layers * (2 * c.hidden * c.ffn + c.ffn + c.hidden)
    return n


def memory(cfg):
    """{per_rank, ranks, reference, need, parts}: the bytes of the docstring's formula."""
    c = cfg.gpt_config()
    share = cfg.replicas * cfg.ep
    weights = BYTES * parameters(cfg)
    kv = theory.cached_kv_bytes(layers=math.ceil(c.layers / cfg.pp),
                                requests=cfg.batch // share, prompt_len=cfg.prompt_len,
                                new_tokens=cfg.new_tokens, hidden=c.hidden, tp=cfg.tp,
                                bytes_per_value=BYTES)
    micro = max(1, cfg.batch // share // cfg.pp)
    scores = SCORE_COPIES * micro * max(1, c.heads // cfg.tp) * cfg.prompt_len ** 2 * BYTES
    per_rank = weights + kv + scores + BYTES_PER_CPU_RANK
    reference = (weights + theory.cached_kv_bytes(
        layers=c.layers, requests=cfg.batch, prompt_len=cfg.prompt_len,
        new_tokens=cfg.new_tokens, hidden=c.hidden, bytes_per_value=BYTES)
        + SCORE_COPIES * cfg.batch * c.heads * cfg.prompt_len ** 2 * BYTES
        + cfg.batch * (cfg.prompt_len + cfg.new_tokens) * c.vocab * BYTES)
    ranks = cfg.world_size * per_rank
    return dict(per_rank=per_rank, ranks=ranks, reference=reference,
                need=max(ranks, reference),
                parts=dict(weights=weights, kv_cache=kv, scores=scores))


def work_flops(cfg):
    """FLOPs of one greedy generation of the whole batch (the docstring's `work`)."""
    c = cfg.gpt_config()
    k = max(1, cfg.top_k) if cfg.experts else 1
    router = c.hidden * cfg.experts   # the MoE router's logits (0 for the dense GPT)
    matmul = c.layers * (4 * c.hidden ** 2 + k * 2 * c.hidden * c.ffn + router) \
        + c.hidden * c.vocab
    b, p, t = cfg.batch, cfg.prompt_len, cfg.new_tokens
    return (2 * matmul * b * (p + t - 1)
            + 4 * c.layers * c.hidden * b * (p * p + (t - 1) * p + t * (t - 1) // 2))


def bytes_moved(cfg):
    """Bytes the decode steps read at least (the docstring's `moved`)."""
    c = cfg.gpt_config()
    b, p, t = cfg.batch, cfg.prompt_len, cfg.new_tokens
    return (t * BYTES * parameters(cfg)
            + 2 * c.layers * b * c.hidden * BYTES * ((t - 1) * p + t * (t - 1) // 2))


@lru_cache(maxsize=None)
def _rates(heads):
    """(FLOP/s of matmuls, bytes/s a copy reads, seconds of a one-token block forward, seconds
    to build a small block, seconds per initialised weight): measured here on one thread (a
    busy machine slows many threads far more than one), best of several; the FLOP/s and
    bytes/s then scaled by the usable CPUs: upper bounds on the rates, so a lower bound on
    the time."""
    a = torch.randn(256, 256)
    small = models.GPTConfig(hidden=heads, heads=heads, ffn=heads, seq=4)   # overhead only
    x = torch.randn(1, 1, small.hidden)
    w = torch.empty(1 << 18)
    src, dst = torch.ones(1 << 22), torch.empty(1 << 22)   # 16 MB: more than a cache holds
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(a, a)   # the first call pays one-off costs
        rate = 2 * 256 ** 3 / _best(lambda: torch.mm(a, a)) * usable_cpus()
        read = src.nbytes / _best(lambda: dst.copy_(src)) * usable_cpus()
        with torch.no_grad():
            block = models.Block(small)
            block(x)
            layer_s = _best(lambda: block(x))
        build_s = _best(lambda: models.Block(small))
        init_s = _best(lambda: torch.nn.init.uniform_(w)) / w.numel()
    finally:
        torch.set_num_threads(threads)
    return rate, read, layer_s, build_s, init_s


def _best(fn, n=7):
    """The shortest of n timings of fn(): the least the machine's other work added."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def seconds(cfg):
    """{seconds, flops, rate, moved, read, layer_s}: the docstring's lower bound for one
    generation."""
    c = cfg.gpt_config()
    rate, read, layer_s, build_s, init_s = _rates(c.heads)
    flops, moved = work_flops(cfg), bytes_moved(cfg)
    build = c.layers * build_s + parameters(cfg) * init_s
    total = flops / rate + moved / read + cfg.new_tokens * c.layers * layer_s + build
    return dict(seconds=total, flops=flops, rate=rate, moved=moved, read=read, layer_s=layer_s)


def check_fits(cfg, timeout_s, available=None):
    """One-line ValueError for a serving run that cannot fit in memory here, or cannot end
    within `timeout_s`; None when it may start."""
    available = available_memory() if available is None else available
    need = memory(cfg)
    if available is not None and need["need"] > available:
        if need["ranks"] >= need["reference"]:
            p = need["parts"]
            what = (f"{cfg.world_size} rank(s) x {_gb(need['per_rank'])} (weights "
                    f"{_gb(p['weights'])} + KV cache {_gb(p['kv_cache'])} + prefill attention "
                    f"scores {_gb(p['scores'])} + {_gb(BYTES_PER_CPU_RANK)} per process)")
        else:
            what = "the single-device reference generation in this process"
        raise ValueError(f"run serve needs about {_gb(need['need'])} but {_gb(available)} is "
                         f"available: {what}; {_shape(cfg)}: choose a smaller shape, batch, "
                         f"prompt or fewer new tokens")
    if timeout_s is None:
        return
    est = seconds(cfg)
    if est["seconds"] > timeout_s:
        raise ValueError(
            f"run serve would take at least {est['seconds']:,.0f} s here (estimated from "
            f"this machine's measured rates: {est['flops']:.3g} FLOPs at "
            f"{est['rate'] / 1e9:.0f} GFLOP/s, {_gb(est['moved'])} of weights and KV cache "
            f"read at {est['read'] / 1e9:.0f} GB/s, {cfg.new_tokens:,} tokens x "
            f"{cfg.gpt_config().layers:,} layers one after the other), more than its "
            f"{timeout_s:g} s limit; {_shape(cfg)}: choose a smaller shape, batch, prompt or "
            f"fewer new tokens")


def _shape(cfg):
    c = cfg.gpt_config()
    return (f"layers={c.layers:,} hidden={c.hidden:,} heads={c.heads} ffn={c.ffn:,} "
            f"vocab={c.vocab:,}, batch {cfg.batch:,} x prompt {cfg.prompt_len:,} + "
            f"{cfg.new_tokens:,} new tokens")
