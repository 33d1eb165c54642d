"""The FLOP/s of compute inside a step: one rate for every modelled second (issue 43).

A GEMM reaches the GPU's measured MAMF ceiling (MAMF / peak, data/hardware.csv;
achievable_fraction) in a microbenchmark, and `kernels.IN_STEP_GEMM_FRACTION` of that inside a
training step (fitted on declared calibration rows, data/kernels.csv). `in_step_gemm_rate` is
peak x both: the rate the training planner gives a large GEMM (shape efficiency 1), serving's
linear layers run at (pricing.linear_layer_rate), and the run clock, theory.time's step times,
the async-TP, context-parallel and MoE step models time compute at.
`compute_rate` with a given `mfu` is the constant-MFU rule instead (mfu x peak): a comparison,
an assumption with no source, never the lab's own model.
"""
from __future__ import annotations

from . import hardware, kernels

_FP8 = ("fp8", "float8", "float8_e4m3fn", "float8_e5m2")


def achievable_fraction(gpu, precision="bf16", override=None):
    """Fraction of the dense peak of `precision` the best large GEMM reaches on `gpu`: the
    ceiling of theory/kernels.py's per-kernel efficiency, measured (MAMF / peak, the public
    microbenchmark in data/hardware.csv; kernels.DEFAULT_MAMF_FRACTION without one), not fitted.
    Each GEMM then runs at this x its shape efficiency. `override` (the user's own fraction, or
    a custom GPU's `achievable`) replaces the bf16 ceiling; fp8 keeps its ratio to bf16."""
    base = override or getattr(gpu, "achievable", None)
    if base is None:
        return kernels.ceiling(gpu, precision)
    return base * kernels.ceiling(gpu, precision) / kernels.ceiling(gpu, "bf16")


def in_step_gemm_rate(gpu, dtype="bf16") -> float:
    """FLOP/s of compute inside a step on one `gpu` in `dtype`: the dtype's dense peak x its
    MAMF ceiling (achievable_fraction) x kernels.IN_STEP_GEMM_FRACTION. fp8 runs at the fp8
    peak and the fp8 ceiling (as pricing.linear_layer_rate); fp32, with no measured ceiling of
    its own, at the fp32 peak x the bf16 ceiling (as kernels.ceiling)."""
    g = hardware.gpu(gpu)
    name = str(dtype).lower().replace("torch.", "")
    precision = "fp8" if name in _FP8 else "bf16"
    return g.flops(dtype) * achievable_fraction(g, precision) * kernels.IN_STEP_GEMM_FRACTION


def compute_rate(gpu, dtype="bf16", mfu=None) -> float:
    """in_step_gemm_rate(gpu, dtype); with `mfu` given, the constant-MFU rule mfu x peak (a
    comparison, e.g. a lesson's stated assumption, not the lab's model)."""
    if mfu is not None:
        return hardware.gpu(gpu).flops(dtype) * mfu
    return in_step_gemm_rate(gpu, dtype)
