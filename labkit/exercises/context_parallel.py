"""Lesson 08's exercise: merge two partial attention results by their log-sum-exp.

The learner writes `merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`: the attention of the same
queries over the keys of block a and block b together, from each block's own softmax output and
log-sum-exp (what ring attention does after every ring step). The checker runs it on cases
built from real attention (ordinary scores, scores large enough to overflow exp, and a query
that has seen no key at all yet, as a causal mask makes) and says what is wrong in plain words.
No ranks are needed: the merge is arithmetic on one device.
"""
import math

import torch

from . import Check, say


def merge(out_a, lse_a, out_b, lse_b):
    """One answer: weights exp(lse_x - lse) with lse = logaddexp(lse_a, lse_b) (never exp of
    a large number), a key-less side (lse = -inf) weighing 0."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse


def partial_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d)) v over these keys only, and each query's log-sum-exp."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v   # a key-less row: zeros
    return out, lse


def _case(kind):
    """(the two partial results, the full attention's out and lse) for one kind of case."""
    g = torch.Generator().manual_seed({"plain": 0, "large": 1, "masked": 2}[kind])
    q, k, v = (torch.randn(2, 6, 8, generator=g) for _ in range(3))
    if kind == "large":   # scores of a few hundred: exp() of them overflows float32
        q, k = q * 12, k * 12
    mask_a = mask_b = None
    if kind == "masked":  # query 0 sees no key of either block yet (a causal mask does this)
        mask_a = torch.ones(6, 3, dtype=torch.bool)
        mask_a[0] = False
        mask_b = torch.ones(6, 3, dtype=torch.bool)
        mask_b[:2] = False
    ka, kb, va, vb = k[:, :3], k[:, 3:], v[:, :3], v[:, 3:]
    out_a, lse_a = partial_attention(q, ka, va, mask_a)
    out_b, lse_b = partial_attention(q, kb, vb, mask_b)
    full_mask = None if mask_b is None else torch.cat([mask_a, mask_b], dim=1)
    out, lse = partial_attention(q, k, v, full_mask)   # query 0: out 0, lse -inf
    return (out_a, lse_a, out_b, lse_b), (out, lse)


def _run(fn, kind):
    args, (out, lse) = _case(kind)
    try:
        got = fn(*(t.clone() for t in args))
    except Exception as error:  # noqa: BLE001 - the learner's code: report, never crash
        return "error", f"{type(error).__name__}: {error}"
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        return "shape", "return a pair (out, lse) of tensors"
    got_out, got_lse = got
    if got_out.shape != out.shape or got_lse.shape != lse.shape:
        return "shape", (f"out should be {tuple(out.shape)} and lse {tuple(lse.shape)}, got "
                         f"{tuple(got_out.shape)} and {tuple(got_lse.shape)}")
    if got_out.isnan().any() or got_lse.isnan().any() or (got_out.isinf().any()):
        return "nonfinite", ""
    if not torch.allclose(got_out, out, atol=1e-5, rtol=1e-4):
        return "out", (got_out - out).abs().max().item()
    if not torch.allclose(got_lse, lse, atol=1e-4, rtol=1e-5):
        return "lse", (got_lse - lse).abs().max().item()
    return "ok", ""


def check_merge(fn, verbose=True):
    """Run the learner's `fn(out_a, lse_a, out_b, lse_b) -> (out, lse)` on three cases; print
    the feedback and return a Check."""
    return say(_judge(fn), verbose)


def _judge(fn):
    verdict, detail = _run(fn, "plain")
    if verdict == "error":
        return Check(False, "error", f"Your function raised {detail}. out_a and out_b are "
                     "(2, 6, 8) (batch, queries, head_dim); lse_a and lse_b are (2, 6).")
    if verdict == "shape":
        return Check(False, "shape", f"Wrong shapes: {detail}.")
    if verdict == "out":
        args, (out, _) = _case("plain")
        average = (args[0] + args[2]) / 2
        if torch.allclose(average, fn(*args)[0], atol=1e-5):
            return Check(False, "average", "You averaged the two outputs. Each block's output "
                         "is normalised by its own softmax sum; weigh it by its share of the "
                         "total: exp(lse_a - lse) with lse = log(exp(lse_a) + exp(lse_b)).")
        return Check(False, "wrong", f"The merged output differs from attention over all the "
                     f"keys (max difference {detail:.3g}). out = exp(lse_a - lse) * out_a + "
                     "exp(lse_b - lse) * out_b, with lse = log(exp(lse_a) + exp(lse_b)).")
    if verdict == "lse":
        return Check(False, "lse", f"The output is right but the returned lse is not (max "
                     f"difference {detail:.3g}): the next merge needs log(exp(lse_a) + "
                     "exp(lse_b)) (torch.logaddexp).")
    if verdict == "nonfinite":
        return Check(False, "nonfinite", "Your result has inf or nan on ordinary scores.")
    verdict, detail = _run(fn, "large")
    if verdict != "ok":
        return Check(False, "overflow", "Right on ordinary scores, but with scores of a few "
                     "hundred exp(lse) overflows float32 (exp(89) is already inf). Never "
                     "exponentiate an lse itself: use torch.logaddexp, and weights "
                     "exp(lse_a - lse) <= 1.")
    verdict, detail = _run(fn, "masked")
    if verdict != "ok":
        return Check(False, "masked", "Right until a query has seen no key in either block "
                     "(both lse = -inf, as a causal mask makes at the start of ring "
                     "attention): then lse is -inf too and -inf - (-inf) is nan. Give such a "
                     "side weight 0 (e.g. .nan_to_num(0.0) on the weights); out stays 0.")
    return Check(True, "", "Correct: the merge is exact (ordinary scores), stable (scores of a "
                 "few hundred) and handles a query that sees no key of a block. Ring attention "
                 "merges one such block per ring step.")
