"""Lesson 05's exercise: top-k routing with capacity and drops, checked against labkit's.

The answer key is the routing of `labkit.parallel.moe` on one rank (the same conventions as
`labkit.models.MoEConfig`): softmax over experts; top-1 weight = the probability, top-k > 1
weights renormalised to sum to 1; each expert takes at most `capacity` assignments, first
choices before second choices, earlier tokens first; the rest are dropped (kept = False).
`check_capacity_answer(answer)` checks a number: the slots per expert for a batch, against
`theory.moe.capacity` (ceil(capacity_factor x k x tokens / experts)).
"""
import torch

from ..parallel.moe import choice_counts, queue_positions, top_k_gates
from ..theory.moe import capacity as capacity_formula
from . import (Check, Hints, Mistake, check_number, not_a_function, say, show, with_hint)


def reference_top_k_routing(logits, k, capacity):
    """The answer key: (expert (T, k), weight (T, k), kept (T, k)) as labkit routes."""
    _, expert, weight = top_k_gates(logits, k)
    counts = choice_counts(expert, logits.shape[-1])[None]   # one rank holds every token
    return expert, weight, queue_positions(expert, logits.shape[-1], counts, 0) < capacity


def _cases():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 4, generator=g), 1, 3), (torch.randn(16, 4, generator=g), 2, 6),
            (torch.randn(24, 4, generator=g) + torch.tensor([2.0, 0, 0, 0]), 1, 4),
            (torch.randn(24, 8, generator=g), 2, 5)]


ROUTING_HINTS = Hints(
    concept="the router's softmax gives each token a probability per expert; a token goes to "
            "its k most probable experts, and an expert takes assignments only while it has a "
            "free slot, all first choices (in token order) before any second choice.",
    code="probs = logits.softmax(-1); weight, expert = probs.topk(k, -1); if k > 1: weight = "
         "weight / weight.sum(-1, keepdim=True); kept = zeros(T, k, bool); used = [0] * E; for "
         "c in range(k): for t in range(T): e = expert[t, c]; if used[e] < capacity: kept[t, c] "
         "= True; used[e] += 1; return expert, weight, kept")
CAPACITY_HINTS = Hints(
    concept="count the assignments (each token makes k of them), share them evenly over the "
            "experts, add the capacity factor's headroom, and remember a slot holds a whole "
            "assignment.",
    code="capacity = ceil(capacity factor x k x T / E).", exercise=2, kind="formula")
HINTS = {1: ROUTING_HINTS, 2: CAPACITY_HINTS}


def show_solution(exercise=1):
    """Print the code (exercise 1) or the formula (exercise 2)."""
    show(HINTS, exercise)


def check_top_k_routing(fn, verbose=True):
    """Check a learner's `fn(logits, k, capacity) -> (expert, weight, kept)`; say what is wrong."""
    if (refused := not_a_function(fn, "fn(logits, k, capacity)")) is not None:
        return say(refused, verbose)
    check = _check_routing(fn)
    check = with_hint(check, ROUTING_HINTS)
    return say(check, verbose)


def _check_routing(fn):
    for logits, k, capacity in _cases():
        where = (f"(T={logits.shape[0]} tokens, E={logits.shape[1]} experts, k={k}, "
                 f"capacity={capacity})")
        try:
            got = fn(logits.clone(), k, capacity)
        except NotImplementedError:
            return Check(False, "not written", "NOT WRITTEN YET: your function raised "
                         f"NotImplementedError. Hint: {ROUTING_HINTS.concept}")
        except Exception as error:   # the learner's code raised: say so, do not raise
            return Check(False, "error", f"Your function raised {error!r} {where}.")
        try:
            got_e, got_w, got_k = (torch.as_tensor(t) for t in got)
        except (TypeError, ValueError, RuntimeError):
            return Check(False, "not a triple", f"Your function returned "
                         f"{type(got).__name__}; return three tensors (expert, weight, kept), "
                         f"each (tokens, k) {where}.")
        problem = _first_problem(logits, k, capacity, got_e, got_w, got_k.bool(), where)
        if problem is not None:
            return problem
    return Check(True, "", "Correct: top-k routing with capacity and drops matches labkit on "
                 "all cases.")


def _first_problem(logits, k, capacity, got_e, got_w, got_k, where):
    want_e, want_w, want_k = reference_top_k_routing(logits, k, capacity)
    if tuple(got_e.shape) != tuple(want_e.shape):
        return Check(False, "shape", f"expert has shape {tuple(got_e.shape)}, expected "
                                     f"{tuple(want_e.shape)} (tokens, k) {where}.")
    for name, got in (("weight", got_w), ("kept", got_k)):
        if tuple(got.shape) != tuple(want_e.shape):
            return Check(False, "shape", f"{name} has shape {tuple(got.shape)}, expected "
                                         f"{tuple(want_e.shape)} (tokens, k) {where}.")
    if got_e.is_floating_point() or got_e.is_complex():
        got_e = got_e.long()
    if not torch.equal(got_e.sort(-1).values, want_e.sort(-1).values):
        return Check(False, "experts", f"Wrong experts chosen {where}: each token must go to "
                                       "its k experts with the largest router probability "
                                       "(softmax of the logits, then topk).")
    if not torch.equal(got_e, want_e):
        return Check(False, "choice order", f"Right experts, wrong order {where}: column 0 "
                                            "must hold each token's first choice (highest "
                                            "probability), column 1 its second.")
    if not torch.allclose(got_w.float(), want_w, atol=1e-5):
        sums = got_w.float().sum(-1)
        hint = ("for k=2 divide the two probabilities by their sum" if k == 2 and
                not torch.allclose(sums, torch.ones_like(sums), atol=1e-4) else
                "for k=1 use the softmax probability itself" if k == 1 else
                "use the softmax probabilities of the chosen experts")
        return Check(False, "weights", f"Wrong gate weights {where}: {hint}.")
    load = torch.bincount(got_e[got_k], minlength=logits.shape[1])
    if (load > capacity).any():
        over = (load > capacity).nonzero().flatten().tolist()
        return Check(False, "capacity", f"Expert(s) {over} keep {load.max().item()} assignments "
                                        f"but the capacity is {capacity} {where}: drop the "
                                        "assignments past the capacity.")
    if got_k.sum() < want_k.sum():
        return Check(False, "over-dropping", f"You keep {int(got_k.sum())} assignments, "
                                             f"{int(want_k.sum())} fit {where}: an expert should "
                                             "fill all its capacity slots before dropping.")
    if not torch.equal(got_k, want_k):
        return Check(False, "drop order", f"The right number of assignments is kept, but not the "
                                          f"right ones {where}: fill each expert's slots with all "
                                          "first choices (in token order) before any second "
                                          "choice, and drop the latest tokens.")
    return None


CAPACITY = dict(tokens=6000, experts=64, top_k=2, capacity_factor=1.25)


def check_capacity_answer(answer, tokens=CAPACITY["tokens"], experts=CAPACITY["experts"],
                          top_k=CAPACITY["top_k"], capacity_factor=CAPACITY["capacity_factor"],
                          verbose=True):
    """Slots per expert (tokens each expert may take) for one batch; a whole number."""
    import math
    t, e, k, cf = tokens, experts, top_k, capacity_factor
    expected = capacity_formula(t, e, k, cf)
    mistakes = [
        Mistake(cf * k * t / e, "not rounded", "a slot holds a whole token: round up to the "
                "next whole slot"),
        Mistake(math.floor(cf * k * t / e), "rounded down", "round up: a fraction of a slot "
                "is a whole slot, or the last token of an evenly loaded expert is dropped"),
        Mistake(math.ceil(cf * t / e), "forgot k", f"each token is sent to k = {k} experts: "
                f"there are k x T = {k * t} assignments to spread, not {t}"),
        Mistake(math.ceil(k * t / e), "forgot the factor", f"that is the even share; the "
                f"capacity factor {cf} adds headroom for an uneven load"),
        Mistake(math.ceil(t / e), "even share", "that is T / E; multiply by k (assignments per "
                "token) and the capacity factor"),
        Mistake(round(cf * k * t / e), "rounded to nearest", "rounded to the nearest whole "
                "slot; round up, or the last assignment of an evenly loaded expert is dropped"),
        Mistake(math.ceil(cf * t / (e * k)), "divided by k", f"that divides by k = {k}; each "
                "token makes k assignments, so multiply"),
    ]
    return check_number(answer, expected, what=f"slots per expert (T = {t} tokens, E = {e} "
                        f"experts, k = {k}, capacity factor {cf})", unit="tokens", exact=True,
                        mistakes=mistakes, verbose=verbose, hints=CAPACITY_HINTS,
                        explain=f"{e} experts x {expected} slots = {e * expected} slots for "
                                f"{k * t} assignments.")
