"""Speculative decoding, greedy: a cheap draft model proposes k tokens, the target model checks
them all in one forward, and every token the target would itself have picked is kept
(Leviathan et al. ICML'23, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).

Per round: the draft runs k decode steps from the last accepted token (k cheap forwards); the
target runs once on those k + 1 tokens (the last accepted one and the k proposals) and yields
its greedy choice after each; the proposals are accepted up to the first disagreement, and the
target's own token at that point is taken too, so a round adds between 1 and k + 1 tokens and
the output is exactly the target's greedy output. With acceptance rate a per proposal
(independent), a round yields (1 - a^(k+1)) / (1 - a) tokens for one target forward.

Rejected proposals leave keys and values beyond the accepted length in the caches; with the
paged cache's explicit positions nothing is erased: the next forward writes over them and reads
only up to its own length. The draft here can be any TinyGPT-shaped model, e.g.
`early_exit_draft(target, layers)`: the target's own first layers and head (self-speculation,
as in Draft & Verify, Zhang et al. ACL'24, arXiv 2309.08168).
"""
import copy

import torch

from .paged_kv import PagedKVCache, check_model, ragged_forward


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


@torch.no_grad()
def speculative_generate(target, draft, prompt, new_tokens, k=4):
    """Greedy tokens of `target` for a 1-D `prompt`, drafted `k` at a time by `draft`.
    Returns (tokens list, stats{rounds, proposed, examined, accepted, acceptance,
    accepted_fraction, target_forwards, draft_forwards, tokens_per_target_forward}).
    acceptance: accepted / examined, the proposals the target compared (up to and including
    the first miss): the per-token probability alpha of Leviathan et al.; accepted_fraction:
    accepted / proposed."""
    for model in (target, draft):
        check_model(model)
    if k < 1 or new_tokens < 1:
        raise ValueError(f"k and new_tokens must be >= 1, got k={k}, new_tokens={new_tokens}")
    total = prompt.numel() + new_tokens + k
    for name, model in (("target", target), ("draft", draft)):
        if total > model.pos.num_embeddings:
            raise ValueError(f"prompt {prompt.numel()} + {new_tokens} new tokens + {k} drafted "
                             f"exceeds the {name}'s {model.pos.num_embeddings} positions")
    big, small = _cache(target, total), _cache(draft, total)
    seq = prompt.tolist() + [int(ragged_forward(target, [(0, prompt, 0)], big)[0].argmax())]
    stats = dict(rounds=0, proposed=0, examined=0, accepted=0, target_forwards=1,
                 draft_forwards=0)
    draft_cached = 0                       # the draft's valid keys and values: seq[:this]
    while len(seq) - prompt.numel() < new_tokens:
        start = len(seq) - 1               # the newest token: the target has not seen it
        ids, pos, proposals = torch.tensor(seq[draft_cached:]), draft_cached, []
        for _ in range(k):                 # the draft catches up, then proposes k tokens
            token = ragged_forward(draft, [(0, ids, pos)], small)[0].argmax()
            pos += ids.numel()
            ids = token.reshape(1)
            proposals.append(int(token))
        check = torch.tensor([seq[-1]] + proposals)     # one target forward checks them all
        choices = ragged_forward(target, [(0, check, start)], big, every_token=True)
        choices = choices.argmax(dim=-1).tolist()       # the target's pick after each input
        accepted = 0
        while accepted < k and proposals[accepted] == choices[accepted]:
            accepted += 1
        seq += proposals[:accepted] + [choices[accepted]]
        # the draft fed seq[start], p1 .. p(k-1): valid as far as they match what was kept
        draft_cached = min(pos, start + accepted + 1)
        for key, n in (("rounds", 1), ("proposed", k), ("accepted", accepted),
                       ("examined", min(k, accepted + 1)),
                       ("target_forwards", 1), ("draft_forwards", k)):
            stats[key] += n
    out = seq[prompt.numel():][:new_tokens]
    stats["acceptance"] = stats["accepted"] / max(1, stats["examined"])
    stats["accepted_fraction"] = stats["accepted"] / max(1, stats["proposed"])
    stats["tokens_per_target_forward"] = len(out) / stats["target_forwards"]
    return out, stats


def expected_tokens_per_round(acceptance, k):
    """Tokens a round yields when each proposal is accepted with probability a, independently
    (Leviathan et al. 2023, eq. 1): (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1:
        return k + 1
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)
