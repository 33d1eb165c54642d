"""labkit.numerics: "equals one device" judged against a float64 run by float32's own error.

A gradient summed in another order (4 shards, then the shards' sums) passes; the same gradient
with a missing average (a real bug) fails; a rule fitted to one order does not flip when the
order changes; losses are compared relative; mismatched names and shapes are refused."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit import numerics
from labkit.runs import reference


def _gradients(model, x, y, shards=1, average=True):
    """The mean-loss gradient, computed whole (shards=1) or as the mean of per-shard gradients
    (what data parallelism all-reduces); `average=False` sums them instead (the bug)."""
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for xs, ys in zip(x.chunk(shards), y.chunk(shards)):
        model.zero_grad()
        F.mse_loss(model(xs), ys).backward()
        for n, p in model.named_parameters():
            total[n] += p.grad / (shards if average else 1)
    return total


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 64, generator=g), torch.randn(64, 8, generator=g)
    exact = _gradients(numerics.exact_copy(model), x.double(), y.double())
    return model, x, y, exact, _gradients(model, x, y)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_another_summation_order_is_within_rounding(setup, shards):
    model, x, y, exact, single = setup
    parallel = _gradients(model, x, y, shards)
    assert any((parallel[n] != single[n]).any() for n in single)   # not bit for bit
    verdict = numerics.compare(parallel, single, exact)
    assert verdict and verdict.error > 0 and verdict.own_error > 0, str(verdict)
    assert "within rounding" in str(verdict) and "NOT" not in str(verdict)


def test_a_missing_average_is_not(setup):
    model, x, y, exact, single = setup
    verdict = numerics.compare(_gradients(model, x, y, 4, average=False), single, exact)
    assert not verdict and verdict.error > 100 * verdict.limit
    assert "NOT within rounding" in str(verdict)


def test_losses_are_relative_and_the_floor_is_a_few_ulps():
    exact = [4.0, 0.25]
    single = [4.0 * (1 + 1e-7), 0.25 * (1 - 1e-7)]
    close = [4.0 * (1 - 2e-7), 0.25 * (1 + 2e-7)]
    far = [4.0, 0.25 * (1 + 1e-5)]               # a small loss off by 1e-5 of itself
    assert numerics.compare_loss(close, single, exact)
    assert not numerics.compare_loss(far, single, exact)
    # float32 exact by luck (own error 0): the floor, a few ulps of the scale, still admits
    # one rounding step of the parallel run
    assert numerics.compare([1.0 + 2 ** -23], [1.0], [1.0])
    assert not numerics.compare([1.0 + 2 ** -15], [1.0], [1.0])


def test_float64_reference_run_is_the_same_training_in_float64():
    cfg = reference.RunConfig(steps=2, optimizer="sgd")
    single, exact = reference.train(cfg, track_memory=False), reference.float64_reference(cfg)
    assert all(p.dtype == torch.float64 for p in exact["params"].values())
    verdict = numerics.compare(single["params"], single["params"], exact["params"])
    assert verdict.error == verdict.own_error and 0 < verdict.own_error < 1e-5
    assert numerics.compare_loss(single["loss"], single["loss"], exact["loss"])


def test_mismatches_are_refused():
    a = {"w": torch.zeros(2)}
    with pytest.raises(KeyError, match="parameter names differ"):
        numerics.compare(a, {"v": torch.zeros(2)}, a)
    with pytest.raises(ValueError, match="shapes differ"):
        numerics.compare(torch.zeros(3), torch.zeros(2), torch.zeros(2))


def test_one_unlucky_element_does_not_flip_the_verdict_but_one_wrong_element_does():
    # rounding noise of a few ulps on 10,000 values; the parallel run's worst element 6x
    # float32's worst (an Adam update of a nearly cancelled gradient), the rest alike
    g = torch.Generator().manual_seed(0)
    exact = torch.rand(10_000, generator=g, dtype=torch.float64) + 0.5
    ulp = torch.finfo(torch.float32).eps
    single = exact + ulp * torch.randn(10_000, generator=g, dtype=torch.float64)
    parallel = exact + ulp * torch.randn(10_000, generator=g, dtype=torch.float64)
    worst = (single - exact).abs().max()
    parallel[7] = exact[7] + 6 * worst
    verdict = numerics.compare(parallel, single, exact)
    assert verdict, str(verdict)
    assert (parallel - exact).abs().max() > numerics.FACTOR * worst   # the max would flip
    wrong = parallel.clone()
    wrong[7] = exact[7] + 1e-3     # one parameter off by a small gradient step: a real bug
    assert not numerics.compare(wrong, single, exact)
