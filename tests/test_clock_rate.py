"""The run clock prices compute at the planner's in-step GEMM rate (issue 43, one time model):
peak x the GPU's measured MAMF ceiling x the fitted in-step fraction
(theory/step_rate.in_step_gemm_rate, also plan_cluster's), not a constant MFU. A run's compute
span of F counted FLOPs lasts F / that rate; the planner's price of a large GEMM (shape
efficiency 1) of the same FLOPs is the same number; changing the fitted fraction moves the
clock (negative control)."""
import pytest
import torch

import labkit
from labkit.runtime.clock import Clock, _Rank
from labkit.theory import hardware, kernels, plan_terms, pricing, time as ttime
from labkit.theory.plan_cluster import in_step_gemm_rate, make_cluster


def _one_rank_spans(ctx):
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with ctx.clock.compute("matmul"):
        a @ b
    ctx.clock.add_compute("formula", 1e12)
    return ctx.clock.flops_per_s, [(e["name"], e["end"] - e["start"], e["meta"])
                                   for e in ctx.clock.timeline() if e["kind"] == "compute"]


def test_a_runs_compute_span_lasts_its_flops_over_the_in_step_gemm_rate():
    rate, spans = labkit.launch(_one_rank_spans, 1)[0]
    assert rate == in_step_gemm_rate("H100", "bf16")     # 8xH100-NVLink, bf16: the default
    (name, seconds, meta), (name2, seconds2, _) = spans
    assert name == "matmul" and meta["flops"] == 2 * 64 * 32 * 16
    assert seconds == pytest.approx(meta["flops"] / in_step_gemm_rate("H100"), rel=1e-12)
    assert name2 == "formula"
    assert seconds2 == pytest.approx(1e12 / in_step_gemm_rate("H100"), rel=1e-12)


def _clock_seconds(flops, gpu="H100", dtype="bf16"):
    clock = Clock(_Rank(0, 1), f"8x{gpu}-NVLink" if gpu != "B200" else "8xB200", dtype)
    clock.add_compute("step", flops)
    return clock.now()


@pytest.mark.parametrize("gpu,precision", [("H100", "bf16"), ("H100", "fp8"),
                                           ("A100", "bf16"), ("B200", "bf16")])
def test_the_same_flops_through_the_planner_and_the_clock_are_one_number(gpu, precision):
    # the planner's price of one large GEMM inside a step: flops / (rate x shape efficiency),
    # rate = the precision's peak x MAMF ceiling (plan_terms.gemm_flops_rate) x in-step fraction
    # m = 128 x SMs: whole waves of 128 x 128 tiles, no tile or wave quantization
    kern = kernels.gemm("big", 128 * kernels.sms(gpu), 8192, 8192, gpu)
    assert kern.efficiency == 1.0
    c = make_cluster(gpu, precision=precision)
    rate = plan_terms.gemm_flops_rate(c, precision) * c.in_step_gemm_fraction
    planned = kernels.kernel_time(kern, rate, kernels.hbm_bandwidth(gpu), launch=0.0)
    assert planned == pytest.approx(kern.flops / (rate * kern.efficiency), rel=1e-12)  # compute
    assert _clock_seconds(kern.flops, gpu, precision) == pytest.approx(planned, rel=1e-9)
    # and serving's linear layers (pricing.linear_layer_rate) run at the same rate
    g = hardware.gpu(gpu)
    assert pricing.linear_layer_rate(g, precision) == pytest.approx(
        in_step_gemm_rate(gpu, precision), rel=1e-12)


def test_the_rates_per_gpu():
    # by hand: each GPU's measured MAMF (data/hardware.csv) x the fitted in-step fraction
    for gpu, mamf_tflops in (("H100", 794.5), ("A100", 271.2), ("B200", 1745.0)):
        g = hardware.gpu(gpu)
        assert in_step_gemm_rate(gpu) == pytest.approx(
            mamf_tflops * 1e12 * kernels.IN_STEP_GEMM_FRACTION, rel=1e-9)


def test_a_modelled_dp_step_computes_at_the_clocks_rate():
    step = ttime.dp_step_time(1e9, gpus=1, cluster="8xH100-NVLink", global_batch_tokens=4096)
    assert step["compute"] == pytest.approx(_clock_seconds(6 * 1e9 * 4096), rel=1e-12)


def test_changing_the_fitted_fraction_moves_the_clock(monkeypatch):
    before = _clock_seconds(1e12)
    monkeypatch.setattr(kernels, "IN_STEP_GEMM_FRACTION", kernels.IN_STEP_GEMM_FRACTION / 2)
    assert _clock_seconds(1e12) == pytest.approx(2 * before, rel=1e-12)


def test_the_clusters_constant_mfu_rule_is_a_comparison_the_clock_does_not_use():
    rule = hardware.cluster("8xH100-NVLink", mfu=0.3)
    assert rule.compute_time(0.3 * 989e12, "bf16") == pytest.approx(1.0)   # mfu x peak
    clock = Clock(_Rank(0, 1), rule)
    clock.add_compute("step", 1e12)
    assert clock.now() == pytest.approx(1e12 / in_step_gemm_rate("H100"), rel=1e-12)
