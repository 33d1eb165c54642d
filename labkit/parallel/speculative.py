"""Speculative decoding: a cheap draft model proposes k tokens, the target model checks them all
in one forward, and rejection sampling keeps the output distributed exactly as the target's
(Leviathan et al. ICML'23, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).

Per round: the draft runs k decode steps from the last accepted token (k cheap forwards),
drawing each proposal x_i from its distribution q_i; the target runs once on those k + 1 tokens
(the last accepted one and the k proposals) and gives its distribution p_i after each. Proposal
x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is
drawn instead from the normalised residual max(0, p_i - q_i) and the round ends; if all k are
accepted, one more token is drawn from p_(k+1). Each token is then distributed as p_i: a round
adds between 1 and k + 1 tokens, all as the target alone would sample them. Greedy decoding
(temperature 0) is the case where p and q are one-hot: a proposal is kept iff it is the
target's argmax, the residual is the target's argmax, so the output is exactly the target's
greedy output. With acceptance alpha per proposal (independent), a round yields
(1 - alpha^(k+1)) / (1 - alpha) tokens for one target forward.

Rejected proposals leave keys and values beyond the accepted length in the caches; with the
paged cache's explicit positions nothing is erased: the next forward writes over them and reads
only up to its own length. The draft here can be any TinyGPT-shaped model, e.g.
`early_exit_draft(target, layers)`: the target's own first layers and head (self-speculation,
as in Draft & Verify, Zhang et al. ACL'24, arXiv 2309.08168).
"""
import copy
import math

import torch

from .paged_kv import PagedKVCache, SamplingParams, check_model, draw, next_token, ragged_forward


def early_exit_draft(target, layers):
    """A draft sharing the target's weights: its embedding, first `layers` blocks, norm and head."""
    if not 1 <= layers < len(target.blocks):
        raise ValueError(f"an early-exit draft keeps 1 to {len(target.blocks) - 1} of the "
                         f"target's {len(target.blocks)} blocks, got {layers}")
    draft = copy.copy(target)                 # shares every module; only the list is cut
    draft._modules = dict(target._modules, blocks=torch.nn.ModuleList(target.blocks[:layers]))
    return draft


def _cache(model, tokens):
    width = model.blocks[0].attn.qkv.out_features // 3
    cache = PagedKVCache(len(model.blocks), width, 1, tokens)
    cache.reserve(0, tokens)
    return cache


def rejection_sample(p, q, proposal, generator=None):
    """Leviathan et al.'s step for one proposal drawn from q: (accepted, token). Accept with
    probability min(1, p[x] / q[x]); else draw from max(0, p - q), normalised (p where that
    is all zero: p equals q up to rounding, and a rejection then has probability ~0)."""
    ratio = p[proposal] / q[proposal] if q[proposal] > 0 else math.inf
    if ratio >= 1 or (ratio > 0 and float(torch.rand((), generator=generator,
                                                     dtype=torch.float64)) < ratio):
        return True, proposal                 # (greedy: a ratio of 1 or 0, nothing drawn)
    residual = (p - q).clamp(min=0)
    return False, draw(residual / residual.sum() if residual.sum() > 0 else p, generator)


@torch.no_grad()
def speculative_generate(target, draft, prompt, new_tokens, k=4, sampling=None):
    """Tokens of `target` for a 1-D `prompt`, drafted `k` at a time by `draft`, picked as
    `sampling` says (a paged_kv.SamplingParams; None: greedy, exactly the target's greedy
    tokens). Returns (tokens list, stats{rounds, proposed, examined, accepted, acceptance,
    acceptance_rate, acceptance_length, accepted_fraction, target_forwards, draft_forwards,
    tokens_per_target_forward}), where
    acceptance: accepted / examined, the proposals the target judged (up to and including
      the first rejection): Leviathan et al.'s per-token acceptance alpha, labkit's measure;
    acceptance_rate: accepted / proposed, vLLM's (`accepted_fraction`, its old name here);
    acceptance_length: 1 + accepted / rounds, vLLM's mean acceptance length: the tokens a
      round yields, the accepted proposals and the target's own token."""
    for model in (target, draft):
        check_model(model)
    if k < 1 or new_tokens < 1:
        raise ValueError(f"k and new_tokens must be >= 1, got k={k}, new_tokens={new_tokens}")
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    total = prompt.numel() + new_tokens + k
    for name, model in (("target", target), ("draft", draft)):
        if total > model.pos.num_embeddings:
            raise ValueError(f"prompt {prompt.numel()} + {new_tokens} new tokens + {k} drafted "
                             f"exceeds the {name}'s {model.pos.num_embeddings} positions")
    generator = sampling.generator()
    big, small = _cache(target, total), _cache(draft, total)
    first = ragged_forward(target, [(0, prompt, 0)], big)[0]
    seq = prompt.tolist() + [next_token(first, sampling, generator)]
    stats = dict(rounds=0, proposed=0, examined=0, accepted=0, target_forwards=1,
                 draft_forwards=0)
    draft_cached = 0                       # the draft's valid keys and values: seq[:this]
    while len(seq) - prompt.numel() < new_tokens:
        start = len(seq) - 1               # the newest token: the target has not seen it
        ids, pos, proposals, drafted = torch.tensor(seq[draft_cached:]), draft_cached, [], []
        for _ in range(k):                 # the draft catches up, then proposes k tokens
            q = sampling.probs(ragged_forward(draft, [(0, ids, pos)], small)[0])
            token = draw(q, generator)
            pos += ids.numel()
            ids = torch.tensor([token])
            proposals.append(token)
            drafted.append(q)
        check = torch.tensor([seq[-1]] + proposals)     # one target forward checks them all
        p = sampling.probs(ragged_forward(target, [(0, check, start)], big, every_token=True))
        accepted, kept = 0, []
        for i in range(k):
            ok, token = rejection_sample(p[i], drafted[i], proposals[i], generator)
            kept.append(token)
            if not ok:
                break
            accepted += 1
        if accepted == k:                  # every proposal kept: the target's next token too
            kept.append(draw(p[k], generator))
        seq += kept
        # the draft fed seq[start], p1 .. p(k-1): valid as far as they match what was kept
        draft_cached = min(pos, start + accepted + 1)
        for key, n in (("rounds", 1), ("proposed", k), ("accepted", accepted),
                       ("examined", min(k, accepted + 1)),
                       ("target_forwards", 1), ("draft_forwards", k)):
            stats[key] += n
    out = seq[prompt.numel():][:new_tokens]
    stats["acceptance"] = stats["accepted"] / max(1, stats["examined"])
    stats["acceptance_rate"] = stats["accepted"] / max(1, stats["proposed"])
    stats["accepted_fraction"] = stats["acceptance_rate"]
    stats["acceptance_length"] = 1 + stats["accepted"] / max(1, stats["rounds"])
    stats["tokens_per_target_forward"] = len(out) / stats["target_forwards"]
    return out, stats


def expected_tokens_per_round(acceptance, k):
    """Tokens a round yields when each proposal is accepted with probability a, independently
    (Leviathan et al. 2023, eq. 1): (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1:
        return k + 1
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)
