"""Routing for ExpertParallel: which experts each token goes to, and which slot it gets.

Conventions (labkit.models.MoELayer's, computed independently there for the one-device
reference): softmax over the experts, each token's top-k experts; top-1 keeps the probability
(Switch Transformer, Fedus et al. 2021, arXiv 2101.03961), top-k > 1 renormalises the k
probabilities to sum to 1 (Mixtral, Jiang et al. 2024). Capacity C = ceil(capacity_factor x k x
T / E) slots per expert for T tokens; queue order (GShard, Lepikhin et al. 2020, arXiv
2006.16668): every first choice of the group (rank by rank, tokens in order) before any second
choice; assignments past C are dropped. Every function here is local arithmetic on the counts
that ExpertParallel all-gathers; the collectives stay in moe.py.
"""
import math

import torch.nn.functional as F


def top_k_gates(logits, top_k, normalize=None):
    """softmax over experts, each token's top-k experts (best first) and their gate weights,
    renormalised to sum 1 when `normalize` (None: when top_k > 1, labkit's convention)."""
    probs = logits.softmax(dim=-1)
    top_p, expert = probs.topk(top_k, dim=-1)
    normalize = top_k > 1 if normalize is None else normalize
    weight = top_p / top_p.sum(dim=-1, keepdim=True) if normalize else top_p
    return probs, expert, weight


def capacity(tokens, experts, top_k, capacity_factor):
    """Slots per expert for `tokens` tokens: ceil(capacity_factor * top_k * tokens / experts);
    capacity_factor None: room for every assignment."""
    if capacity_factor is None:
        return int(tokens) * top_k
    return math.ceil(capacity_factor * top_k * int(tokens) / experts)


def choice_counts(expert, experts):
    """(k, E): how many tokens chose expert e as their j-th choice."""
    return F.one_hot(expert, experts).sum(dim=0)


def queue_positions(expert, experts, counts_by_rank, index):
    """(T, k) slot of each of rank `index`'s (token, choice) in its expert's queue.

    counts_by_rank (N, k, E) holds every rank's choice_counts. Ahead of rank `index`'s j-th
    choices for expert e: all choices < j of the group, then the j-th choices of earlier ranks,
    then this rank's earlier tokens.
    """
    total = counts_by_rank.sum(dim=0)
    ahead = total.cumsum(dim=0) - total + counts_by_rank[:index].sum(dim=0)   # (k, E)
    onehot = F.one_hot(expert, experts)                                      # (T, k, E)
    earlier = onehot.cumsum(dim=0) - onehot
    return ((earlier + ahead) * onehot).sum(dim=-1)


def kept_per_rank(counts_by_rank, slots):
    """(N, E): how many of each rank's assignments to expert e fit in its `slots`."""
    total = counts_by_rank.sum(dim=0)
    start = (total.cumsum(dim=0) - total) + (counts_by_rank.cumsum(dim=0) - counts_by_rank)
    return (slots - start).clamp(min=0).minimum(counts_by_rank).sum(dim=1)
