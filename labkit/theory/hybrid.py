"""DP x TP x PP on one mesh, predicted: the planner's bytes per GPU for labkit's tiny GPT.

The planner (theory/planner.py) sums, for the worst pipeline stage, the model states of the
stage's layers split by tp (and the optimizer state by dp under ZeRO-1) and the activations of
the micro-batches the schedule keeps in flight (Narayanan et al. 2021, arXiv 2104.04473;
Korthikanti et al. 2022, arXiv 2205.05198). Here it is asked about the tiny GPT as labkit's
hybrid run trains it: fp32 Adam, no dropout, the softmax stored, no CUDA reserve.

ZeRO-3 / FSDP on the mesh (TP -> PP -> FullyShard over dp_shard, HSDP replicas across
dp_replicate; Rajbhandari et al. 2020, arXiv 1910.02054; Zhao et al. 2023, arXiv 2304.11277):
the stage's TP-split weights, gradients and optimizer state each divided by dp_shard = dp / R,
activations unchanged. Bytes a rank sends per step (ring model, B = the stage's TP-split
weights in bytes, S = dp_shard, m micro-batches; FullyShard gathers twice and reduce-scatters
once per micro-batch):

    dp_shard:      3 m (S - 1) / S x B
    dp_replicate:  2 (R - 1) / R x B / S       (the shards' gradients, one all-reduce)

With experts (ep > 1, ep | S) FullyShard shards the B_E bytes of this rank's experts over
their replicas within the dp_shard group, E = S / ep ranks (torchtitan's dp_shard_mod_ep;
sharding them over all S would mix ranks holding different experts), the rest (B - B_E) over
dp_shard as above; the replicas across dp_replicate hold the same experts:

    dp_shard:      3 m (S - 1) / S x (B - B_E)
    ep_dp:         3 m (E - 1) / E x B_E
    dp_replicate:  2 (R - 1) / R x ((B - B_E) / S + B_E / E)

Context parallelism on the mesh (cp ranks per sequence, ring attention; Liu et al. 2023,
arXiv 2310.01889): every rank keeps s / cp tokens of each sequence, so activations fall by cp
(the planner's `cp` term); the weights are those of the dp ranks, so ZeRO shards over
dp x cp (S = dp_shard x cp above). Bytes a rank sends per step on `cp`, for each attention
layer of its stage and each micro-batch of b sequences (K, V of its shard: 2 b (h/tp)
(s/cp) d values of 4 bytes; theory/context_parallel.comm_bytes_per_rank):

    cp:  (cp - 1) KV forward + (cp - 1) KV + cp dKV backward   (ring, fp32 partial sums)
"""
from __future__ import annotations

from . import context_parallel, planner


def tiny_gpt_memory(*, layers, hidden, heads, ffn, vocab, seq, global_batch, dp, tp, pp,
                    microbatches=2, virtual=1, sequence_parallel=False, zero=0,
                    optimizer="adam", dp_replicate=1, cp=1) -> dict | None:
    """Bytes per GPU (worst stage) by category and their sum `peak`; None where the planner has
    no such plan (e.g. more stages than blocks: it gives the embedding and the head no stage
    of their own)."""
    shape = (f"layers={layers},hidden={hidden},heads={heads},ffn={ffn},"
             f"vocab={vocab},seq={seq},arch=gpt,tied=false")
    # ZeRO-3: the planner's replicated plan, model states / dp_shard below (the planner
    # itself refuses ZeRO-3 with a pipeline, as Megatron-LM and DeepSpeed do)
    fix = dict(dp=dp, tp=tp, pp=pp, cp=cp, v=virtual, zero_stage=0 if zero == 3 else zero,
               recompute="none",
               micro_batch_size=global_batch // (dp * microbatches),
               sequence_parallel=sequence_parallel)
    try:
        plan = planner.plan(shape, dp * tp * pp * cp, "H100", global_batch=global_batch, seq=seq,
                            precision="fp32", dropout=False, flash_attention=False, fix=fix,
                            top=1)["plans"][0]
    except ValueError:
        return None
    # a CPU run has no CUDA context or caching allocator: the reserve is left out
    out = {k: v for k, v in plan["memory_bytes"].items() if k not in ("total", "reserved")}
    if zero == 3:
        for key in ("params", "grads", "optimizer"):
            out[key] /= dp // dp_replicate * cp
    if optimizer == "sgd":
        out["optimizer"] = 0
    out["peak"] = sum(out.values())
    return out


def fsdp_wire_bytes(params, dp_shard, dp_replicate=1, microbatches=1, dtype_bytes=4,
                    expert_params=0, ep=1) -> dict:
    """Ring-model bytes one rank sends per step under ZeRO-3 on the mesh (module docstring),
    by mesh dimension: {"dp_shard": ..., "dp_replicate": ...} (+ "ep_dp" with experts);
    `params`: the rank's TP-split stage parameters, `expert_params` of them its experts'
    (spread over ep ranks; sharded over dp_shard / ep) (modelled)."""
    dense, experts = (params - expert_params) * dtype_bytes, expert_params * dtype_bytes
    s, r, e = dp_shard, dp_replicate, dp_shard // ep
    out = {"dp_shard": 3 * microbatches * (s - 1) / s * dense,
           "dp_replicate": 2 * (r - 1) / r * (dense / s + experts / e)}
    if expert_params:
        out["ep_dp"] = 3 * microbatches * (e - 1) / e * experts
    return out


def cp_wire_bytes(*, layers, micro_batch, heads, seq, head_dim, dp, tp, cp, microbatches,
                  dtype_bytes=4) -> float:
    """Ring-model bytes sent on the `cp` dimension per step, summed over every rank (module
    docstring): each of the `layers` attention layers runs on dp x tp x cp ranks (its pipeline
    stage's), once per micro-batch, each rank with h / tp heads (modelled)."""
    per_call = context_parallel.comm_bytes_per_rank(
        micro_batch, heads // tp, seq, head_dim, cp, dtype_bytes=dtype_bytes,
        grad_bytes=4)["total"]
    return layers * microbatches * dp * tp * cp * per_call
