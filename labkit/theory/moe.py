"""Closed forms for Mixture of Experts: capacity and drops, all-to-all bytes, total vs active
parameters and FLOPs, memory per GPU under expert parallelism, and an inference throughput model.

Capacity C = ceil(capacity_factor * k * T / E) slots per expert (Fedus et al. 2021, Switch
Transformer, arXiv 2101.03961, with k = 1); expected drops sum_e E[max(0, n_e - C)] with
n_e ~ Binomial(T k, q_e). Expert parallelism over N ranks moves (N-1)/N of each rank's T k h
dispatched values per all-to-all, 2 per layer forward and 2 backward (GShard, arXiv 2006.16668).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from . import catalog, hardware
from .step_rate import compute_rate
from .time import collective_time, wire_bytes_per_rank


# ------------------------------------------------------------------------- capacity and drops

def capacity(tokens, experts, top_k=1, capacity_factor=1.25) -> int:
    """Slots per expert: ceil(capacity_factor * top_k * tokens / experts) (Switch for k = 1)."""
    return math.ceil(capacity_factor * top_k * tokens / experts)


def skewed_shares(experts, skew=0.0) -> list:
    """Share of assignments each expert gets under a Zipf-like skew: q_e ~ (e + 1)^-skew.

    skew = 0 is uniform routing; skew = 1 sends expert 0 about 2x expert 1's tokens, and so on.
    """
    q = [(e + 1.0) ** -float(skew) for e in range(experts)]
    return [v / sum(q) for v in q]


def _binomial_pmf(n, p, upto):
    """P(X = i) for i = 0 .. upto, X ~ Binomial(n, p), in logs (no overflow), vectorised.

    log P(i + 1) - log P(i) = log(n - i) - log(i + 1) + log(p / (1 - p)): a cumulative sum.
    """
    if p <= 0 or p >= 1:
        return (np.arange(upto + 1) == (0 if p <= 0 else n)).astype(np.float64)
    i = np.arange(upto, dtype=np.float64)
    steps = np.log(n - i) - np.log1p(i) + math.log(p) - math.log1p(-p)
    log_pmf = n * math.log1p(-p) + np.concatenate(([0.0], np.cumsum(steps)))
    return np.exp(log_pmf)


def expected_overflow(assignments, share, cap) -> float:
    """E[max(0, n - cap)] for n ~ Binomial(assignments, share): mean - cap + E[max(0, cap - n)]."""
    if cap >= assignments:
        return 0.0
    pmf = _binomial_pmf(assignments, share, cap)
    overflow = assignments * share - cap + float(np.dot(cap - np.arange(cap + 1), pmf))
    return max(0.0, float(overflow))   # clip float rounding below zero


def expected_tokens_dropped(tokens, experts, top_k=1, capacity_factor=1.25, skew=0.0,
                            shares=None) -> dict:
    """Expected dropped assignments in one routing group of `tokens` tokens.

    Each of the T k assignments independently picks expert e with probability q_e (`shares`, or
    skewed_shares(experts, skew)); exact for top-1 routing of i.i.d. tokens, an approximation for
    top-2 (a token's two choices are distinct). Also the drops if routing followed q exactly.
    """
    q = skewed_shares(experts, skew) if shares is None else [float(v) for v in shares]
    n, cap = tokens * top_k, capacity(tokens, experts, top_k, capacity_factor)
    dropped = sum(expected_overflow(n, float(p), cap) for p in q)
    mean_only = sum(max(0.0, n * p - cap) for p in q)
    return dict(capacity=cap, assignments=n, dropped=dropped, fraction=dropped / n,
                dropped_if_exact_shares=mean_only)


def load_imbalance(load) -> float:
    """max load / mean load over experts (assignments per expert): 1.0 is perfectly balanced."""
    load = [float(v) for v in load]
    return max(load) / (sum(load) / len(load))


def load_over_steps(routing, steps, layer=0) -> list:
    """Per-expert assignments summed over `steps` (a range) of a run's per-step routing stats
    ({"load": [per layer [per expert]]}, as labkit's MoE runs report them)."""
    return [sum(routing[s]["load"][layer][e] for s in steps)
            for e in range(len(routing[0]["load"][layer]))]


# ---------------------------------------------------------------------------- all-to-all bytes

def all_to_all_bytes_per_rank(tokens_per_rank, top_k, hidden, ep, *, bytes_per_value=4,
                              layers=1, training=True) -> float:
    """Wire bytes each rank sends for expert parallelism, balanced routing, no drops:
    (2 forward + 2 backward, or 2 for inference) x (N-1)/N x T k h x bytes, per layer."""
    calls = 4 if training else 2
    payload = tokens_per_rank * top_k * hidden * bytes_per_value
    return layers * calls * wire_bytes_per_rank("all_to_all", payload, ep)


def all_to_all_wire_bytes_from_rows(sent_plus_received_rows, hidden, ep, bytes_per_value=4):
    """The same from measured rows: forward hands dispatch S (sent) and combine R (received)
    rows, backward hands R and S again; each op's wire bytes are (N-1)/N of what it is handed."""
    return 2 * wire_bytes_per_rank("all_to_all",
                                   sent_plus_received_rows * hidden * bytes_per_value, ep)


def all_gather_dispatch_bytes_per_rank(tokens_per_rank, hidden, ep, *, bytes_per_value=4,
                                       layers=1, training=True) -> float:
    """The naive alternative: every rank all-gathers every token (and reduce-scatters the
    outputs back), (N-1) T h each way; backward the mirror. Independent of k."""
    payload = tokens_per_rank * hidden * bytes_per_value
    per_layer = (wire_bytes_per_rank("all_gather", payload, ep)
                 + wire_bytes_per_rank("reduce_scatter", payload * ep, ep))
    return layers * per_layer * (2 if training else 1)


def expert_parallel_run_comm(*, steps, layers, dense_params, dense_tensors, expert_params,
                             expert_tensors, experts, top_k, hidden, ep, world,
                             rows) -> dict:
    """Ring-model bytes per rank by op for a run of labkit's EP training (fp32, modelled).

    all_to_all: 4 per layer-step on the `rows` this rank sent and received (summed over the
    run). all_reduce once per step: dense grads over the world, and (world > ep) this rank's
    E/ep experts over their world/ep replicas, a presence flag per tensor in each. all_gather
    of the k E + 1 routing counts (8-byte integers) per layer-step, and of each layer's local
    experts once at the end (the report's parameters). Parameter counts are the whole model's.
    """
    local_expert, local_tensors = expert_params // ep, expert_tensors // ep
    reduce = steps * wire_bytes_per_rank("all_reduce", 4 * (dense_params + dense_tensors), world)
    if world > ep:
        reduce += steps * wire_bytes_per_rank(
            "all_reduce", 4 * (local_expert + local_tensors), world // ep)
    gather = (steps * layers * wire_bytes_per_rank("all_gather", 8 * (top_k * experts + 1), ep)
              + layers * wire_bytes_per_rank("all_gather", 4 * local_expert // layers, ep))
    return dict(all_to_all=all_to_all_wire_bytes_from_rows(rows, hidden, ep),
                all_reduce=reduce, all_gather=gather)


# ------------------------------------------------------------------ parameters, FLOPs, memory

def expert_params_per_layer(model) -> int:
    """One expert's SwiGLU MLP: 3 h ffn (Mixtral/Llama layout)."""
    m = catalog.model(model)
    return 3 * m.hidden * m.ffn


def param_split(model) -> dict:
    """Total, active, all experts' and the dense (non-expert) parameter counts."""
    m = catalog.model(model)
    total, active = m.param_count(), m.active_param_count()
    experts = m.layers * m.experts * expert_params_per_layer(m)
    return dict(total=total, active=active, experts=experts, dense=total - experts,
                active_fraction=active / total)


def flops_per_token(model, training=False) -> dict:
    """2 x params per token forward (6 x for training), total vs active (Kaplan et al. 2020);
    attention-score FLOPs left out."""
    s = param_split(model)
    f = 6 if training else 2
    return dict(total=f * s["total"], active=f * s["active"], ratio=s["total"] / s["active"])


def memory_per_gpu(model, ep, *, bytes_per_param=2, training=False) -> dict:
    """Weights per GPU with E/ep experts per GPU and the dense part replicated: dense + experts /
    ep. training=True: mixed-precision Adam, 16 bytes per parameter (ZeRO paper), no sharding."""
    s = param_split(model)
    per_param = 16 if training else bytes_per_param
    dense, experts = s["dense"] * per_param, s["experts"] / ep * per_param
    return dict(dense=dense, experts=experts, total=dense + experts, ep=ep)


def expert_parallel_state_bytes(dense_params, expert_params, ep, optimizer="adam") -> dict:
    """fp32 states per rank under expert parallelism: 4 B weights + 4 B grads (+ 8 B Adam
    moments unless plain SGD) for the dense params + E/ep of the experts' params."""
    local = dense_params + expert_params // ep
    out = dict(params=4 * local, grads=4 * local, optimizer=0 if optimizer == "sgd" else 8 * local)
    out["model_states"] = sum(out.values())
    return out


def with_experts(model, experts, top_k=None):
    """The same shape with another number of experts / top-k (a hypothetical model)."""
    m = catalog.model(model)
    return replace(m, name=f"{m.name}-{experts}e", experts=experts, top_k=top_k or m.top_k,
                   display_name=f"{m.display_name} with {experts} experts, top-{top_k or m.top_k}",
                   params_published=None, active_params_published=None)


# ------------------------------------------------------------------------ throughput model

def experts_touched(local_experts, experts, top_k, tokens) -> float:
    """Expected distinct experts among `local_experts` that at least one of `tokens` tokens
    routes to (uniform routing): local_experts * (1 - (1 - k/E)^tokens)."""
    return local_experts * (1 - (1 - top_k / experts) ** tokens)


def padded_rows(tokens, experts, top_k, capacity_factor=None) -> int:
    """Expert rows one GPU computes and dispatches for `tokens` tokens (modelled).

    capacity_factor None: the T k assignments themselves (dropless, or a capacity nothing
    reaches: labkit's layer computes only the kept rows). A number: fixed-shape dispatch
    (GShard, Switch) fills every expert's C = ceil(cf k T / E) slots, used or not, so E C rows
    are computed and sent: about cf T k, padding included above cf = 1, drops below it.
    """
    if capacity_factor is None:
        return tokens * top_k
    return experts * capacity(tokens, experts, top_k, capacity_factor)


def moe_step(model, *, gpus=1, ep=None, tokens_per_gpu=4096, phase="prefill", gpu="H100 SXM",
             link="NVLink 4", bytes_per_param=2, mfu=None, overlap=False,
             capacity_factor=None) -> dict:
    """Modelled seconds for one forward step of `tokens_per_gpu` tokens on each of `gpus` GPUs.

    Dense part data-parallel (a replica per GPU), experts spread E/ep per GPU, balanced routing.
    compute = 2 * (tokens * dense params + expert rows * one expert's params) / F, F the
    in-step GEMM rate (step_rate.compute_rate; a given `mfu`: the constant-MFU rule, mfu x
    peak, for comparison),
    expert rows = tokens * k without a capacity, padded_rows(...) with one (the padding a
    capacity factor above 1 costs). memory = bytes of weights read once per step: the dense
    part + the local experts that any token touches (decode reads weights for a few tokens:
    memory-bound). all-to-all = 2 per layer of (expert rows * h) values, alpha-beta on `link`.
    step = max(compute, memory) + all-to-all (or max of all three with overlap=True).
    phase only labels the row ('prefill': many tokens per GPU, 'decode': one per sequence).
    KV-cache reads and attention-score FLOPs are left out.
    """
    m = catalog.model(model)
    g = hardware.gpu(gpu)
    ep = ep or gpus
    s = param_split(m)
    per_expert = m.layers * expert_params_per_layer(m)
    local = m.experts / ep
    rows = padded_rows(tokens_per_gpu, m.experts, m.top_k, capacity_factor)
    flops = 2 * (tokens_per_gpu * (s["active"] - m.top_k * per_expert) + rows * per_expert)
    compute = flops / compute_rate(g, "bf16", mfu)
    touched = experts_touched(local, m.experts, m.top_k, tokens_per_gpu * ep)
    weights_read = (s["dense"] + touched * per_expert) * bytes_per_param
    memory = weights_read / g.memory_bw
    payload = rows * m.hidden * bytes_per_param
    a2a = 2 * m.layers * collective_time("all_to_all", payload, ep, link) if ep > 1 else 0.0
    step = max(compute, memory, a2a) if overlap else max(compute, memory) + a2a
    held = (s["dense"] + local * per_expert) * bytes_per_param
    return dict(phase=phase, gpus=gpus, ep=ep, tokens_per_gpu=tokens_per_gpu, compute_s=compute,
                memory_s=memory, all_to_all_s=a2a, step_s=step, expert_rows=rows,
                padding=rows / (tokens_per_gpu * m.top_k) - 1,
                bound="compute" if compute >= memory else "memory",
                tokens_per_s=gpus * tokens_per_gpu / step, weights_per_gpu=held,
                fits=held <= g.memory_bytes, link=hardware.link(link).name if ep > 1 else "-")


def dense_step(model, *, gpus=1, tokens_per_gpu=4096, gpu="H100 SXM", bytes_per_param=2,
               mfu=None, params=None) -> dict:
    """A dense model of `params` parameters (default: the MoE's total) as pure data parallelism:
    every token runs every weight; step = max(compute, weights read), compute at moe_step's
    rate."""
    g = hardware.gpu(gpu)
    n = params or param_split(model)["total"]
    compute = 2 * tokens_per_gpu * n / compute_rate(g, "bf16", mfu)
    memory = n * bytes_per_param / g.memory_bw
    step = max(compute, memory)
    return dict(compute_s=compute, memory_s=memory, step_s=step,
                tokens_per_s=gpus * tokens_per_gpu / step)


def claim_8_table(model="mixtral-8x7b", experts=16, gpus=16, prefill_tokens=4096,
                  decode_batch=8, links=("NVLink 4", "InfiniBand NDR")):
    """The source article's "16 experts on 16 GPUs, about eightfold throughput", modelled.

    For top-1 and top-2, prefill and decode, each link: throughput of the hypothetical
    16-expert model with one expert per GPU over (a) the same model on one GPU (as if it fit)
    and (b) a dense model with the same total parameters on the same 16 GPUs.
    """
    rows = []
    for k in (1, 2):
        shape = with_experts(model, experts, k)
        for phase, tokens in (("prefill", prefill_tokens), ("decode", decode_batch)):
            one = moe_step(shape, gpus=1, ep=1, tokens_per_gpu=tokens, phase=phase)
            dense = dense_step(shape, gpus=gpus, tokens_per_gpu=tokens)
            for link in links:
                spread = moe_step(shape, gpus=gpus, ep=gpus, tokens_per_gpu=tokens, phase=phase,
                                  link=link)
                rows.append(dict(top_k=k, phase=phase, link=spread["link"],
                                 bound=spread["bound"], tokens_per_gpu=tokens,
                                 one_gpu_tok_s=one["tokens_per_s"], one_gpu_fits=one["fits"],
                                 ep_tok_s=spread["tokens_per_s"],
                                 all_to_all_share=spread["all_to_all_s"] / spread["step_s"],
                                 vs_one_gpu=spread["tokens_per_s"] / one["tokens_per_s"],
                                 vs_dense_same_total=spread["tokens_per_s"]
                                 / dense["tokens_per_s"]))
    return rows
