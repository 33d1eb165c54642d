"""theory/roofline.py against hand-derived cases, and lesson 04's roofline exercise checker."""
import pytest

from labkit.exercises import zero as exercise
from labkit.theory import roofline

# By hand from data/hardware.csv: H100 989e12 bf16 FLOP/s; NVLink 4 450 GB/s at 0.822 (NCCL's
# 370 GB/s effective), InfiniBand NDR 50 GB/s (400 Gb/s) at 0.94 (46-48 GB/s per NIC).
H100, NVLINK, NDR = 989e12, 450e9 * 0.822, 50e9 * 0.94


def test_ridge_is_flops_per_byte_of_the_link():
    assert roofline.ridge("H100", "NVLink 4") == pytest.approx(H100 / NVLINK)
    assert roofline.ridge("H100", "InfiniBand NDR") == pytest.approx(H100 / NDR)
    assert roofline.ridge("H100", "InfiniBand NDR", effective=False) == pytest.approx(
        H100 / 50e9)
    assert roofline.ridge("H100", "NVLink 4", mfu=0.5) == pytest.approx(H100 / 2 / NVLINK)


def test_dp_and_fsdp_intensity_by_hand():
    # DP, 2 GPUs, bf16: 6 N B FLOPs over 2 (1/2) 2N = 2N bytes -> 3 B
    assert roofline.intensity("dp", 1000, 1e9, 2) == pytest.approx(3000)
    # FSDP, 4 GPUs: 3 (3/4) 2N = 4.5 N bytes -> 6B / 4.5 = 4B/3
    assert roofline.intensity("fsdp", 900, 1e9, 4) == pytest.approx(1200)
    # FSDP always sends 1.5x DP's bytes
    assert roofline.comm_bytes_per_gpu("fsdp", 7e8, 16) == pytest.approx(
        1.5 * roofline.comm_bytes_per_gpu("dp", 7e8, 16))


def test_critical_batch_balances_compute_and_communication():
    expected = H100 / NDR * 3 * 63 / 64 * 2 / 6      # FSDP, 64 GPUs, bf16
    assert roofline.critical_batch("fsdp", 64, "H100", "InfiniBand NDR") == pytest.approx(
        expected)
    assert roofline.critical_batch("dp", 8, "H100", "NVLink 4") == pytest.approx(
        H100 / NVLINK * 2 * 7 / 8 * 2 / 6)
    for technique in ("dp", "fsdp"):
        b = roofline.critical_batch(technique, 64, "H100", "InfiniBand NDR")
        compute, comm = roofline.times(technique, b, 8e9, 64, "H100", "InfiniBand NDR")
        assert compute == pytest.approx(comm)
        compute, comm = roofline.times(technique, 2 * b, 8e9, 64, "H100", "InfiniBand NDR")
        assert compute == pytest.approx(2 * comm)
    assert roofline.critical_batch("dp", 1) == 0.0


def test_tp_intensity_does_not_depend_on_the_batch():
    h = 4096
    layer = 12 * h * h                    # 4 h^2 attention + 8 h^2 MLP
    by_hand = 3 * layer / (4 * h * 2 * 7)   # t = 8
    assert roofline.tp_intensity(h, layer, 8) == pytest.approx(by_hand)
    for tokens in (1, 4096, 10 ** 6):
        assert roofline.intensity("tp", tokens, layer, 8, hidden=h) == pytest.approx(by_hand)
    # 9 h / (2 (t-1)) >= ridge: NVLink 4 allows t - 1 <= 13.4 at h = 8192, NDR t - 1 <= 1.49
    assert roofline.tp_max_degree(8192, 12 * 8192 ** 2, link="NVLink 4") == 14
    assert roofline.tp_max_degree(8192, 12 * 8192 ** 2, link="InfiniBand NDR") == 2


def test_errors_are_one_line():
    with pytest.raises(ValueError, match="technique must be one of"):
        roofline.intensity("pp", 1, 1, 2)
    with pytest.raises(ValueError, match="tokens= and hidden="):
        roofline.comm_bytes_per_gpu("tp", 1, 2)
    with pytest.raises(ValueError, match="tp_max_degree"):
        roofline.critical_batch("tp", 8)


def test_exercise_checker_names_the_mistakes():
    right = roofline.critical_batch("fsdp", 64, "H100", "InfiniBand NDR")
    assert exercise.check_fsdp_critical_batch(round(right), verbose=False).ok
    dp = roofline.critical_batch("dp", 64, "H100", "InfiniBand NDR")
    assert exercise.check_fsdp_critical_batch(dp, verbose=False).problem == "DP's bytes"
    line = exercise.check_fsdp_critical_batch(H100 / 50e9 * 3 * 63 / 64 * 2 / 6,
                                              verbose=False)
    assert line.problem == "line rate"
    assert exercise.check_fsdp_critical_batch(right / 8, verbose=False).problem == "bits"
    assert exercise.check_fsdp_critical_batch(None, verbose=False).problem == "no answer"


def test_alpha_beta_fit_recovers_a_known_link():
    """Times made by the alpha-beta model itself (4 ranks: 6 ring steps, 1.5 S on the wire)
    with 3% noise: the fit finds alpha and beta again."""
    import random
    alpha, beta = 50e-6, 2e9
    rng = random.Random(0)
    sizes = [2 ** k for k in range(10, 27, 2)]
    seconds = [(6 * alpha + 1.5 * s / beta) * (1 + rng.uniform(-0.03, 0.03)) for s in sizes]
    got_alpha, got_beta = roofline.fit_alpha_beta(sizes, seconds, 4)
    assert got_alpha == pytest.approx(alpha, rel=0.05)
    assert got_beta == pytest.approx(beta, rel=0.05)
    # latency = bandwidth time at 6 alpha = 1.5 S / beta: S = 4 alpha beta
    assert roofline.half_latency_bytes(alpha, beta, 4) == pytest.approx(4 * alpha * beta)


def test_figures_draw_the_ridges_and_the_critical_batches():
    import matplotlib
    matplotlib.use("Agg")
    from labkit.viz.roofline import all_reduce_fit_figure, roofline_figure
    fig = roofline_figure(64, "H100", links=("NVLink 4", "InfiniBand NDR"),
                          tp=dict(hidden=8192, layer_params=12 * 8192 ** 2, degrees=[8]))
    ax = fig.axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    fsdp = roofline.critical_batch("fsdp", 64, "H100", "InfiniBand NDR")
    assert any(f"{fsdp:,.0f} (InfiniBand NDR)" in text for text in legend)
    assert any(text.startswith("TP=8") for text in legend)
    ridges = {round(line.get_ydata()[0]) for line in ax.get_lines()
              if len(line.get_ydata()) == 2 and line.get_ydata()[0] == line.get_ydata()[1]}
    assert {round(roofline.ridge("H100", "NVLink 4")),
            round(roofline.ridge("H100", "InfiniBand NDR"))} <= ridges
    fig = all_reduce_fit_figure([1e3, 1e6], [1e-4, 1e-3], 5e-5, 1e9, {"m": [2e-6, 1e-5]})
    assert "α = 50 µs" in " ".join(t.get_text() for t in fig.axes[0].get_legend().get_texts())
