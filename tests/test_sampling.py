"""Sampling (vLLM's temperature, top-p and per-request seed) and speculative decoding by
Leviathan et al.'s rejection sampling: greedy stays exact token for token; a seeded request
draws the same tokens batched as alone; the rejection rule and whole speculative generations
give the target's distribution (chi-square over many seeded draws, small vocabulary);
vLLM's acceptance_rate and acceptance_length beside labkit's alpha."""
import math

import pytest
import torch

from labkit import models
from labkit.parallel import serving
from labkit.parallel.batching import Engine, Request
from labkit.parallel.paged_kv import PagedKVCache, SamplingParams, draw, next_token
from labkit.parallel.speculative import rejection_sample, speculative_generate

ALPHA = 1e-3          # the chi-square tests' significance level


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is faster than several contending on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def chi2_sf(x, df):
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)
    (series for P below a + 1, Lentz's continued fraction above; Numerical Recipes 6.2)."""
    a, x = df / 2, x / 2
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1 / a
        n = a
        while abs(term) > 1e-15 * abs(total):
            n += 1
            term *= x / n
            total += term
        return 1 - total * math.exp(log_front)
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = 1 / (an * d + b)
        c = b + an / c
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def chi2_pvalue(counts, probs):
    n = sum(counts)
    keep = [i for i, p in enumerate(probs) if p > 0]
    assert all(counts[i] == 0 for i in range(len(probs)) if probs[i] == 0)
    stat = sum((counts[i] - n * probs[i]) ** 2 / (n * probs[i]) for i in keep)
    return chi2_sf(stat, len(keep) - 1)


def test_chi2_sf_by_known_quantiles():
    # chi-square tables: P(X >= 24.32) = 0.001 at 7 degrees, P(X >= 3.841) = 0.05 at 1
    assert chi2_sf(24.322, 7) == pytest.approx(1e-3, rel=1e-3)
    assert chi2_sf(3.8415, 1) == pytest.approx(0.05, rel=1e-3)
    assert chi2_sf(2.0, 4) == pytest.approx(math.exp(-1) * 2, rel=1e-9)   # (1 + x/2) e^-x/2


def test_temperature_and_top_p_by_hand():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    full = torch.softmax(logits.double(), -1)
    assert torch.allclose(SamplingParams(1.0).probs(logits), full)
    assert torch.allclose(SamplingParams(0.5).probs(logits), torch.softmax(2 * logits.double(),
                                                                          -1))
    # top-p 0.7: the first token holds 0.64 < 0.7, so the second joins; the rest are cut
    nucleus = SamplingParams(1.0, top_p=0.7).probs(logits)
    assert torch.allclose(nucleus, torch.cat([full[:2] / full[:2].sum(), torch.zeros(2,
                                              dtype=torch.float64)]))
    assert SamplingParams().probs(logits).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert next_token(logits, SamplingParams()) == 0
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(seed=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_draws_follow_the_distribution_and_greedy_draws_nothing():
    probs = SamplingParams(0.8, top_p=0.9).probs(torch.tensor([1.0, 0.5, 0.0, -0.5, -3.0]))
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(4000)]), minlength=5)
    assert counts[4] == 0 and chi2_pvalue(counts.tolist(), probs.tolist()) > ALPHA
    logits = torch.randn(7)
    state = torch.get_rng_state()
    assert draw(SamplingParams().probs(logits), None) == int(logits.argmax())
    assert torch.equal(torch.get_rng_state(), state)


def _gpt(seed, layers, vocab=128, seq=48):
    return models.build("gpt", seed=seed, seq=seq, layers=layers, hidden=16, heads=2, ffn=32,
                        vocab=vocab).eval()


def test_a_seeded_request_draws_the_same_tokens_batched_as_alone():
    model = _gpt(0, 2)
    g = torch.Generator().manual_seed(1)
    specs = [(torch.randint(0, 128, (n,), generator=g), out, 0.002 * i,
              SamplingParams(1.0, top_p=0.9, seed=100 + i) if i % 3 else SamplingParams())
             for i, (n, out) in enumerate([(5, 8), (12, 6), (3, 9), (9, 7), (7, 5), (4, 8)])]

    def serve(max_num_seqs, seed_shift=0):
        reqs = [Request(i, p, out, t, SamplingParams(s.temperature, s.top_p,
                                                     None if s.seed is None
                                                     else s.seed + seed_shift))
                for i, (p, out, t, s) in enumerate(specs)]
        engine = Engine(model, PagedKVCache(2, 16, 40, 4), "continuous", max_num_seqs, 16,
                        step_time=lambda pieces: 1e-3)
        return [r.generated for r in engine.run(reqs)]
    batched, alone = serve(4), serve(1)
    assert batched == alone
    for i, (p, out, _, s) in enumerate(specs):
        if s.greedy:        # greedy stays exactly lesson 09's generate
            assert batched[i] == serving.generate(model, p[None], out)[0].tolist()
    shifted = serve(4, seed_shift=1)
    assert [batched[i] == shifted[i] for i in range(6)] == [s.greedy for *_, s in specs]


def test_rejection_sampling_gives_the_target_distribution():
    """x ~ q, kept with min(1, p/q), else redrawn from max(0, p - q): distributed as p."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1, 0.0], dtype=torch.float64)
    q = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.05, 0.25], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    tokens, kept = [], 0
    for _ in range(6000):
        ok, token = rejection_sample(p, q, draw(q, g), g)
        tokens.append(token)
        kept += ok
    counts = torch.bincount(torch.tensor(tokens), minlength=6).tolist()
    assert chi2_pvalue(counts, p.tolist()) > ALPHA
    # the acceptance probability is sum min(p, q) (Leviathan et al., section 3.3)
    assert kept / 6000 == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.02)
    # and the test has power: the proposals themselves are far from p
    proposals = torch.bincount(torch.stack([torch.multinomial(q, 1, generator=g)[0]
                                            for _ in range(2000)]), minlength=6).tolist()
    assert sum(proposals) == 2000 and proposals[5] > 0       # p gives token 5 no mass


@torch.no_grad()
def _exact_marginals(model, prompt, steps, temperature):
    """P(token at step s) for s < steps of the target sampled alone, by enumeration."""
    vocab = model.cfg.vocab
    seqs, weights, out = prompt[None], torch.ones(1, dtype=torch.float64), []
    for _ in range(steps):
        probs = SamplingParams(temperature).probs(model(seqs)[:, -1])     # (n, vocab)
        joint = weights[:, None] * probs
        out.append(joint.sum(0))
        seqs = torch.cat([seqs.repeat_interleave(vocab, 0),
                          torch.arange(vocab).repeat(len(seqs))[:, None]], 1)
        weights = joint.reshape(-1)
    return out


def test_speculative_sampling_gives_the_target_distribution():
    """2,000 seeded generations of 3 tokens (k = 2) by a draft of another seed, vocab 8: the
    tokens drafted and checked (2nd and 3rd) are distributed as the target alone samples
    them; the draft's own distribution is not."""
    target, draft = _gpt(0, 2, vocab=8, seq=16), _gpt(3, 1, vocab=8, seq=16)
    prompt = torch.tensor([1, 5, 2])
    want = _exact_marginals(target, prompt, 3, 1.0)
    draft_own = _exact_marginals(draft, prompt, 2, 1.0)[1]
    counts = torch.zeros(3, 8)
    rates, lengths, alphas = [], [], []
    for seed in range(2000):
        out, st = speculative_generate(target, draft, prompt, 3, k=2,
                                       sampling=SamplingParams(1.0, seed=seed))
        counts[torch.arange(3), torch.tensor(out)] += 1
        rates.append(st["acceptance_rate"])
        lengths.append(st["acceptance_length"])
        alphas.append(st["acceptance"])
    for step in range(3):
        assert chi2_pvalue(counts[step].tolist(), want[step].tolist()) > ALPHA, step
    assert chi2_pvalue(counts[1].tolist(), draft_own.tolist()) < ALPHA
    assert 0 < sum(rates) / 2000 < 1 and 1 < sum(lengths) / 2000 < 3


def test_acceptance_measures_are_defined_as_vllm_and_leviathan():
    target = _gpt(0, 3, seq=64)
    prompt = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(2))
    want = serving.generate(target, prompt[None], 21)[0].tolist()
    same, s = speculative_generate(target, target, prompt, 21, k=4)
    assert same == want
    assert s["acceptance_rate"] == s["acceptance"] == 1.0 and s["acceptance_length"] == 5.0
    far, s = speculative_generate(target, _gpt(5, 1, seq=64), prompt, 21, k=4)
    assert far == want                      # greedy: exactly the target's tokens
    assert s["acceptance_rate"] == s["accepted"] / s["proposed"]
    assert s["acceptance"] == s["accepted"] / s["examined"] >= s["acceptance_rate"]
    assert s["acceptance_length"] == 1 + s["accepted"] / s["rounds"]
    with pytest.raises(ValueError, match="SamplingParams"):
        speculative_generate(target, target, prompt, 4, sampling=0.7)
