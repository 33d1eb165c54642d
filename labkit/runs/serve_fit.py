"""Will a `run serve` fit here, and end within its time? Answered before any rank starts.

The bounds are theory/serve_bounds.py's (memory from the shape; time from the counted FLOPs
and bytes at this machine's rates); this module measures those rates here, now, and refuses
in one line a run that needs more memory than is available or more time than its timeout
(it could only end in an out-of-memory kill or a timeout).

The rates (`_rates`): the FLOP/s of a matmul on one thread times the usable CPUs (an upper
bound on what the model's small matmuls reach); the bytes per second a large copy reads (one
thread, times the usable CPUs); a one-token forward of one block and building one block
(module overhead, plus its weights at the measured initialisation rate), each the best of
several timings: the least the machine's other work added.
"""
import time
from functools import lru_cache

import torch

from .. import models
from ..runtime.cpus import BYTES_PER_CPU_RANK, available_memory, usable_cpus
from ..theory import serve_bounds as bounds
from ..theory.serve_bounds import bytes_moved, parameters, work_flops  # noqa: F401 (the API)
from .preflight import _gb   # GB, or TB past a thousand; safe for huge shapes


def memory(cfg):
    """theory/serve_bounds.memory with this machine's bytes per CPU rank process."""
    return bounds.memory(cfg, BYTES_PER_CPU_RANK)


@lru_cache(maxsize=None)
def _rates(heads):
    """serve_bounds.MachineRates (FLOP/s of matmuls, bytes/s a copy reads, seconds of a
    one-token block forward, to build a small block, per initialised weight): measured here
    on one thread (a busy machine slows many threads far more than one), best of several;
    the FLOP/s and bytes/s then scaled by the usable CPUs: upper bounds on the rates, so a
    lower bound on the time."""
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
    return bounds.MachineRates(rate, read, layer_s, build_s, init_s)


def _best(fn, n=7):
    """The shortest of n timings of fn(): the least the machine's other work added."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def seconds(cfg):
    """theory/serve_bounds.seconds at the rates measured here (once per head count)."""
    return bounds.seconds(cfg, _rates(cfg.gpt_config().heads))


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
