"""The kernel-level time model (labkit/theory/kernels.py): each kernel max(FLOPs at its shape's
efficiency, bytes at achievable HBM bandwidth) + a launch; tile and wave quantization as
NVIDIA's Matrix Multiplication Background guide computes them; constants sourced."""
import csv

import pytest

from labkit.theory import catalog, hardware, kernels, profile, serving, transformer as tf


def test_every_constant_has_a_source():
    with (hardware.TABLES / "kernels.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["source"].strip() and r["value"].strip() for r in rows)
    names = {r["name"] for r in rows}
    assert {"tile_shapes", "tile_k", "hbm_fraction", "launch_s", "sms default"} <= names
    assert 1e-6 <= kernels.LAUNCH_S <= 1e-5 and 0 < kernels.HBM_FRACTION < 1


def test_a_kernel_is_the_max_of_its_flops_and_bytes_plus_a_launch():
    rate, bw, launch = 1e15, 2e12, 4e-6
    compute_bound = kernels.Kernel("k", flops=2e12, bytes=1e9, efficiency=0.5)
    # 2e12 / (1e15 x 0.5) = 4 ms of math against 1e9 / 2e12 = 0.5 ms of bytes
    assert kernels.kernel_time(compute_bound, rate, bw, launch) == pytest.approx(4e-3 + 4e-6)
    memory_bound = kernels.Kernel("k", flops=1e9, bytes=4e9)
    assert kernels.kernel_time(memory_bound, rate, bw, launch) == pytest.approx(2e-3 + 4e-6)
    assert kernels.kernel_time(kernels.elementwise("add", 0), rate, bw, launch) == launch


def test_wave_quantization_as_the_guide_counts_it():
    # 256 x 128 tiles on an A100's 108 SMs: 2304 x 1536 is 9 x 12 = 108 tiles, one full wave
    assert kernels.tile_efficiency(2304, 1536, 4096, 108, (256, 128)) == pytest.approx(1.0)
    # one more column needs a 13th tile column: 117 tiles, 2 waves, about half of them idle
    assert kernels.tile_efficiency(2304, 1537, 4096, 108, (256, 128)) == pytest.approx(
        2304 * 1537 / (2 * 108 * 256 * 128))
    # K in steps of 64: K = 65 runs 128
    assert kernels.tile_efficiency(2304, 1536, 65, 108, (256, 128)) == pytest.approx(65 / 128)
    # the library picks the best tile, never below any one of them, never above 1
    for shape in ((2304, 1537, 4096), (1, 4096, 4096), (5000, 3000, 1000)):
        best = kernels.shape_efficiency(*shape, 108)
        assert 0 < best <= 1
        assert all(best >= kernels.tile_efficiency(*shape, 108, t) for t in kernels.TILES)


def test_efficiency_falls_for_small_and_ragged_shapes():
    sms = kernels.sms("H100")
    assert sms == 132
    big = kernels.shape_efficiency(8192, 8192, 8192, sms)
    assert big > 0.95
    # a batch-1 GEMV: 64 of 132 SMs busy with 64 x 64 tiles of which one row is useful
    assert kernels.shape_efficiency(1, 4096, 4096, sms) == pytest.approx(1 / 132)
    assert kernels.shape_efficiency(16, 4096, 4096, sms) < kernels.shape_efficiency(
        512, 4096, 4096, sms) < big
    assert kernels.shape_efficiency(4097, 4096, 4100, sms) < kernels.shape_efficiency(
        4096, 4096, 4096, sms)
    with pytest.raises(ValueError, match="GEMM dimensions"):
        kernels.shape_efficiency(0, 4096, 4096, sms)


def test_no_gemm_beats_the_measured_matmul_ceiling():
    h100 = hardware.gpu("H100")
    # the ceiling is stas00/ml-engineering's MAMF over the datasheet peak: 794.5 / 989
    assert kernels.ceiling(h100) == pytest.approx(794.5 / 989)
    assert kernels.ceiling(h100, "fp8") == pytest.approx(1402.6 / 1979)
    rate = h100.bf16_flops * kernels.ceiling(h100)
    m = catalog.model("llama-3-8b")
    for tokens in (1, 7, 512, 8192):
        for k in kernels.layer_kernels(m, tokens, 4096, h100, tp=2):
            if k.flops:
                assert k.flops / kernels.kernel_time(k, rate, 1e30, 0.0) <= 794.5e12 * 1.000001
    # a GPU without a measurement: the stated default; a custom one the default SM count too
    custom = hardware.custom_gpu(500, 80, 2.0)
    assert kernels.ceiling(custom) == kernels.DEFAULT_MAMF_FRACTION == 0.80
    assert kernels.sms(custom) == 132


def test_a_layers_kernels_carry_the_layers_flops():
    # the decomposition against transformer.py's count: 2 per weight + 4 s h (all scores)
    for name in ("llama-3-8b", "gpt3-175b"):
        m = catalog.model(name) if name != "gpt3-175b" else catalog.ModelShape(
            name="g", display_name="g", arch="gpt", layers=96, hidden=12288, heads=96,
            kv_heads=96, ffn=49152, vocab=50304)
        layer = kernels.layer_kernels(m, 4096, 4096, "H100", causal=False, flash=False)
        # GPT's biases (4h + f + h per token, 2 FLOPs each) ride in the GEMMs' epilogues
        biases = 0 if m.arch != "gpt" else 4096 * 2 * (5 * m.hidden + m.ffn)
        assert sum(k.flops for k in layer) + biases == pytest.approx(
            4096 * tf.layer_forward_flops_per_token(m, 4096), rel=1e-9)
        # a causal FlashAttention kernel runs half the scores
        flash = kernels.layer_kernels(m, 4096, 4096, "H100")
        saved = 4096 * tf.attention_core_flops_per_token(m, 4096) / 2
        assert sum(k.flops for k in layer) - sum(k.flops for k in flash) == pytest.approx(saved)


def test_the_kernel_sum_is_never_below_the_roofline():
    g = hardware.gpu("H100")
    rate, bw = g.bf16_flops * kernels.ceiling(g), kernels.hbm_bandwidth(g)
    m = catalog.model("llama-3-70b")
    for tokens, ctx, seqs in ((1, 1025, 1), (64, 2049, 64), (8192, 8192, 1)):
        layer = kernels.layer_kernels(m, tokens, ctx, g, tp=8, sequences=seqs)
        assert kernels.forward_time(layer, rate, bw) >= kernels.roofline_time(layer, rate, bw)


def test_batch_one_decode_is_slower_than_its_roofline():
    m, g = catalog.model("llama-3-8b"), hardware.gpu("H100")
    t = serving.serving_time(m, gpu="H100", batch=1, prompt_len=1024, new_tokens=1)
    weights = serving.weight_bytes(m)["total"]
    assert t["tpot_s"] > weights / g.memory_bw          # the datasheet roofline
    assert t["tpot_s"] > weights / kernels.hbm_bandwidth(g)
    assert t["decode_breakdown_s"]["launch"] > 0 and t["decode_bound"] == "memory"


def test_a_measured_profile_sets_ceiling_and_bandwidth_to_its_own():
    measured = dict(gpu="NVIDIA H200", torch="x", cuda=None, hbm_gbps=4000.0,
                    gemm=[dict(m=8192, n=8192, k=8192, dtype="bf16", tflops=750.0)],
                    decode_step_s=[], train_step_s=[], all_reduce=[])
    g = profile.profiled_gpu(profile.check_profile(measured))
    assert kernels.ceiling(g) == 1.0 and kernels.hbm_bandwidth(g) == 4000e9
    assert kernels.sms(g) == 132          # the profiled H200 keeps its SM count


def test_elementwise_bytes_forward_and_backward_by_hand():
    """Llama 3 8B, 8192 tokens, tp=1: a = 2 B x 8192 x 4096. Forward reads inputs and writes the
    output; backward of y = f(x_1..x_n) reads dy and the x_i and writes the dx_i; linear maps
    (rotary, residual adds) move the gradient as the forward moved the value."""
    m = catalog.model("llama-3-8b")
    a = 2 * 8192 * 4096
    layer = kernels.layer_kernels(m, 8192, 8192, "H100")
    by = {}
    for k in layer:
        if not kernels.is_gemm(k):
            by.setdefault(k.name, []).append((k.bytes / a, k.backward_bytes / a))
    assert by["norm"] == [(2, 3), (2, 3)]
    assert by["residual"] == [(3, 3), (3, 3)]
    assert by["rope"] == [(pytest.approx(2.5), pytest.approx(2.5))]   # q and k: 40 x 128 wide
    assert by["activation"] == [(pytest.approx(3 * 3.5), pytest.approx(5 * 3.5))]   # SwiGLU
    # sequence parallelism splits the norms and residuals by tp; dropout adds 1-byte masks
    sp = kernels.layer_kernels(m, 8192, 8192, "H100", tp=4, sp=True, dropout=True)
    norm = next(k for k in sp if k.name == "norm")
    residual = next(k for k in sp if k.name == "residual")
    assert norm.bytes == pytest.approx(2 * a / 4)
    assert residual.bytes == pytest.approx(3 * a / 4 + a / 8)      # + the 1-byte mask
    assert residual.backward_bytes == pytest.approx(5 * a / 4 + a / 8)


def test_elementwise_time_is_its_bytes_over_the_bandwidth():
    from labkit.theory import plan_terms, planner
    m = catalog.model("llama-3-8b")
    c = planner.make_cluster("H100", 8)
    work = kernels.training_forward(m, 8192, 8192, c.gpu, 1, 1, 1, True, True, 2, 1e15, 1e15)
    bw = kernels.hbm_bandwidth(c.gpu)
    a = 2 * 8192 * 4096
    one = plan_terms.elementwise_time(c, work, 1, 0.0)
    assert one == pytest.approx((55 * a + work["head_bytes"]) / bw)
    # a fully recomputed layer runs its forward element-wise kernels again: 2a + 2.5a + ...
    again = plan_terms.elementwise_time(c, work, 1, 1.0) - one
    assert again == pytest.approx(work["forward_bytes"] / bw)
    assert work["forward_bytes"] == pytest.approx((2 + 2.5 + 3 + 2 + 10.5 + 3) * a)


def test_backward_gemms_run_at_their_own_shapes():
    """Y = X W with X tokens x K, W K x N: dgrad is M x N @ N x K, wgrad K x M @ M x N, each
    with the forward's FLOPs and its own tile and wave quantization (NVIDIA's Linear layers
    guide); FlashAttention's backward is 2.5 x its forward's FLOPs (its recompute inside)."""
    sms = kernels.sms("H100")
    fwd = kernels.gemm("mlp down", 1000, 4096, 14336, "H100")
    dgrad, wgrad = kernels.backward(fwd, "H100")
    assert dgrad.flops == wgrad.flops == fwd.flops == 2 * 1000 * 4096 * 14336
    assert dgrad.efficiency == kernels.shape_efficiency(1000, 14336, 4096, sms)
    assert wgrad.efficiency == kernels.shape_efficiency(14336, 4096, 1000, sms)
    # a thin inner dimension (K = 100 runs 128) quantizes differently in each of the three
    # GEMMs, so backward is not simply twice the forward's time
    thin = kernels.gemm("thin", 8192, 4096, 100, "H100")
    assert {b.efficiency for b in kernels.backward(thin, "H100")} == {
        kernels.shape_efficiency(8192, 100, 4096, sms)} != {thin.efficiency}
    m = catalog.model("llama-3-8b")
    flash = next(k for k in kernels.layer_kernels(m, 8192, 8192, "H100")
                 if k.name == "flash attention")
    (back,) = kernels.backward(flash, "H100")
    assert back.flops == pytest.approx(2.5 * flash.flops)
    # forward and backward each at their own measured rate (FlashAttention-3's paper, cuDNN
    # on H100, head dim 128, 8K, causal: 529 forward; backward 518 x 529 / 600)
    best = 989e12 * kernels.ceiling("H100")
    assert flash.efficiency * best == pytest.approx(529e12, rel=0.02)
    assert back.efficiency * best == pytest.approx(518e12 * 529 / 600, rel=0.02)


def test_attention_rates_come_from_the_measured_curves():
    """Interpolated in log2 of the length between the paper's bars, flat beyond them; the H200
    runs the H100's curves; a GPU without a curve gets the stated default fraction."""
    rate = kernels.attention_rate
    assert rate("H100", 128, 4096, False) == pytest.approx(609e12)
    assert rate("H100", 128, 2 ** 11.5, True) == pytest.approx((484e12 + 518e12) / 2)
    assert rate("H100", 128, 10 ** 6, True) == rate("H100", 128, 16384, True) == 539e12
    assert rate("H200", 64, 8192, False) == rate("H100", 64, 8192, False) == 412e12
    assert rate("H100", 128, 8192, False, "backward") == 518e12
    a100 = hardware.gpu("A100 SXM 80GB")
    assert rate(a100, 128, 8192) == pytest.approx(kernels.DEFAULT_ATTENTION_FRACTION * 312e12)


def test_a_cp_ring_runs_attention_as_cp_blocks():
    m = catalog.model("llama-3-8b")
    whole = next(k for k in kernels.layer_kernels(m, 4096, 8192, "H100")
                 if k.name == "flash attention")
    ring = next(k for k in kernels.layer_kernels(m, 4096, 8192, "H100", ring=2)
                if k.name == "flash attention")
    assert ring.flops == pytest.approx(whole.flops)       # the same work, in 2 launches
    assert ring.launches == 2 and whole.launches == 1


def test_training_pays_the_fp32_cross_entropy_over_the_logits():
    """Megatron-Core's vocab-parallel cross entropy on logits.float(): 38 bytes per logit
    forward (cast, max, subtract, exp, sum, divide), 14 backward; the logits split by tp."""
    m = catalog.model("llama-3-8b")
    loss = next(k for k in kernels.head_kernels(m, 8192, "H100", tp=4, loss=True)
                if k.name == "cross entropy")
    logits = 8192 * m.vocab / 4
    assert (loss.bytes, loss.backward_bytes) == (38 * logits, 14 * logits)
    assert not any(k.name == "cross entropy" for k in kernels.head_kernels(m, 1, "H100"))
