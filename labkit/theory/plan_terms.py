"""The terms of one plan's memory and step time, each a named function (planner.evaluate adds
them up). Formulas and sources are in each docstring; the constants they share:

- Model states reuse memory.model_state_bytes with fp32 main gradients: 2 (bf16 weights) + 4
  (fp32 gradients) + 12 (fp32 master weights and Adam moments) = 18 bytes per parameter, the
  convention of Megatron-LM and FSDP2 (ZeRO's paper counts 16, with bf16 gradients).
- ALLOCATOR_RESERVE: the CUDA context, cuBLAS/NCCL workspaces and the caching allocator's
  fragmentation, an assumption (~1 GiB of context and workspaces is typical on H100; the rest
  is blocks the allocator holds but cannot reuse), shown as its own memory term.
"""
from __future__ import annotations

from . import kernels, memory, transformer as tf
from .time import collective_time

ALLOCATOR_RESERVE = 2 * 2**30   # bytes; an assumption, see the module docstring
BUCKET_BYTES = 40e6 * 4         # Megatron-LM's default gradient bucket: 40M fp32 gradients
ADAM_BYTES_TOUCHED = 30         # read grad, master, m, v (16 B); write master, m, v, bf16 (14 B)
# Transformer Engine's cast-transpose reads a bf16 value (2 B) and writes its fp8 copy and the
# fp8 copy transposed (1 + 1 B): Hopper's fp8 tensor cores take only the TN layout, so backward
# needs the transpose (TE docs, "FP8 primer").
FP8_CAST_BYTES = 4
CURRENT_SCALING_BYTES = 2       # current scaling's amax pass reads the bf16 value again
GRAD_BYTES = 4                  # fp32 main gradients (see the module docstring)


def stage_parameters(m, tp, ep, pp, layers_per_stage):
    """(parameters of the worst pipeline stage, of one layer) on one GPU: experts spread over
    ep ranks, matmuls split by tp; the first stage adds the embedding, the last the head (a copy
    when tied)."""
    counts = tf.layer_counts(m)
    layer = counts.attention / tp + counts.mlp_total / (tp * ep) + counts.router + counts.norms
    embedding, head = tf.embedding_params(m) / tp, tf.head_params(m) / tp
    ends = embedding + (0 if m.tied_embeddings else head) if pp == 1 else max(embedding, head)
    return layers_per_stage * layer + ends, layer


def expert_parameters(m, tp, ep, layers_per_stage):
    """Of `stage_parameters`' count, the experts' on one GPU (spread over ep, split by tp): ZeRO
    shards them over their replicas, dp x cp / ep ranks, not over dp x cp (ranks of one EP
    group hold different experts; torchtitan's dp_shard_mod_ep). 0 for a dense model."""
    return layers_per_stage * tf.layer_counts(m).mlp_total / (tp * ep) if m.experts > 1 \
        else 0.0


def sharded_states(stage_params, expert_params, precision, zero_stage, shard, ep):
    """`model_states` of a stage whose `expert_params` are sharded over shard / ep ranks, the
    rest over `shard` (the ranks holding the same weights)."""
    dense = model_states(stage_params - expert_params, precision, zero_stage, shard)
    if not expert_params:
        return dense
    experts = model_states(expert_params, precision, zero_stage, shard // ep)
    return {k: dense[k] + experts[k] for k in dense}


def model_states(stage_params, precision, zero_stage, shard):
    """Weights, gradients and optimizer state per GPU (memory.model_state_bytes, ZeRO over the
    `shard` ranks that hold the same weights): bf16/fp8 runs keep bf16 weights, fp32 main
    gradients and fp32 Adam state (18 B per parameter); fp32 runs 4 + 4 + 8."""
    mixed = precision != "fp32"
    return memory.model_state_bytes(stage_params, mixed_precision=mixed, zero_stage=zero_stage,
                                    world_size=shard, grad_bytes=GRAD_BYTES)


def zero3_buffers(layer_params, zero_stage, weight_bytes=2):
    """ZeRO-3 keeps two gathered layers in flight (the one computing, the one prefetched)."""
    return 2 * weight_bytes * layer_params if zero_stage == 3 else 0.0


def gemm_flops_rate(c, precision):
    """FLOP/s the best large GEMM reaches in the linear layers' precision: the dense peak x the
    measured MAMF ceiling (plan_cluster.achievable_fraction); kernels.py lowers it per shape.
    Under fp8 (Transformer Engine) only the linear layers run in fp8; attention
    and the head stay in bf16."""
    if precision == "fp8":
        return c.gpu.flops("fp8") * c.achievable_fp8
    return c.gpu.bf16_flops * c.achievable


def attention_time_factor(flash, causal):
    """Share of the attention-core FLOPs a kernel runs: FlashAttention skips the blocks a causal
    mask zeroes (about half); an unfused softmax computes every score. HFU counts this share;
    MFU counts the causal half whatever the kernel (transformer.model_flops_per_token), so
    neither passes 1 at any sequence length."""
    return 0.5 if flash and causal else 1.0


def tp_collectives_per_layer(recompute, recompute_share):
    """All-reduces (or reduce-scatter + all-gather pairs under SP) per layer and micro-batch:
    2 forward + 2 backward, and the 2 forward ones again for each fully recomputed layer; as
    many all-to-alls of an MoE layer under EP (dispatch and combine)."""
    return 4 + (2 * recompute_share if recompute == "full" else 0)


def tp_collective_bytes(m, tokens, value_bytes=2):
    """Payload of one TP collective: the layer's activations, value_bytes x tokens x hidden."""
    return value_bytes * tokens * m.hidden


def tp_comm_time(c, m, tokens, tp, layers, collectives_per_layer, value_bytes=2):
    """One micro-batch's TP traffic on one stage: each collective moves the layer's activations
    (tp_collective_bytes) among tp ranks (alpha-beta ring, time.py)."""
    act = tp_collective_bytes(m, tokens, value_bytes)
    return layers * collectives_per_layer * collective_time("all_reduce", act, tp, c.link(tp))


def message_bytes(precision):
    """Bytes per value of a run's activations (kept, and exchanged as TP, CP, PP, EP messages)
    and of the weights ZeRO gathers: 4 in an fp32 run, else 2 (bf16; fp8 runs keep bf16
    outside the GEMMs, Transformer Engine's default)."""
    return 4 if precision == "fp32" else 2


def cp_ring_bytes(m, tokens, tp, cp, value_bytes=2, recompute_share=0.0):
    """Bytes one rank sends on context parallelism's K/V ring per layer and micro-batch (Liu et
    al. 2023, arXiv 2310.01889): its K and V shard, `hop` = 2 value_bytes x tokens x h_kv d /
    tp (tokens: this rank's s / cp of each sequence), passed cp-1 hops forward; backward K, V
    again and their gradients cp-1 hops each: 3 (cp-1) hops, + cp-1 for the forward again of
    the fully recomputed share of layers (selective recompute leaves the ring core alone: it
    keeps no scores to drop, so no hop repeats; parallel/recompute.py). {'hop', 'hops',
    'total'}."""
    hop = 2 * value_bytes * tokens * m.kv_heads * m.head_dim / tp
    hops = (3 + recompute_share) * (cp - 1) if cp > 1 else 0
    return dict(hop=hop, hops=hops, total=hops * hop)


def cp_ring_times(c, m, seq, tokens, tp, cp, layers, attention_s_per_layer, value_bytes=2,
                  recompute_share=0.0):
    """(total, exposed) seconds of context parallelism's K/V ring for one micro-batch: each of
    cp_ring_bytes' hops a send, hidden under one block of attention (one layer's forward +
    backward attention, `attention_s_per_layer`, / cp / 3) unless the link is slower."""
    if cp <= 1:
        return 0.0, 0.0
    ring = cp_ring_bytes(m, tokens, tp, cp, value_bytes, recompute_share)
    hop = collective_time("send", ring["hop"], 2, c.link(cp * tp))
    block = attention_s_per_layer / cp / 3
    total = layers * ring["hops"] * hop
    return total, layers * ring["hops"] * max(0.0, hop - block)


def ep_all_to_all_bytes(m, tokens, value_bytes=2):
    """Payload of one expert-parallel all-to-all (GShard, Lepikhin et al. 2020, arXiv
    2006.16668; Switch, Fedus et al. 2021): each of a rank's tokens goes to its top_k experts,
    tokens x top_k x hidden x value_bytes, of which (ep-1)/ep leave the rank (balanced
    routing); dispatch and combine forward and backward per MoE layer and micro-batch, and
    forward again when recomputed (tp_collectives_per_layer's count)."""
    return value_bytes * tokens * min(m.top_k, m.experts) * m.hidden


def ep_comm_time(c, m, tokens, ep, layers, span, calls_per_layer, value_bytes=2):
    """Seconds of one micro-batch's expert all-to-alls on one stage (calls_per_layer of
    ep_all_to_all_bytes per MoE layer, ring model among ep ranks within `span` consecutive
    GPUs), on the critical path: the experts wait for the rows they run."""
    if ep <= 1 or m.experts <= 1:
        return 0.0
    one = collective_time("all_to_all", ep_all_to_all_bytes(m, tokens, value_bytes), ep,
                          c.link(span))
    return layers * calls_per_layer * one


def pp_send_bytes(m, tokens, tp, value_bytes=2):
    """Payload of one pipeline send: the tp-scattered activations, value_bytes x tokens x
    hidden / tp."""
    return value_bytes * tokens * m.hidden / tp


def pp_send_time(c, m, tokens, tp, span, pp, microbatches, v, value_bytes=2):
    """Activation sends between stages: forward and backward, per micro-batch and chunk, of the
    tp-scattered activations (value_bytes x tokens x hidden / tp)."""
    if pp <= 1:
        return 0.0
    one = collective_time("send", pp_send_bytes(m, tokens, tp, value_bytes), 2, c.link(span))
    return 2 * microbatches * v * one


def grad_reductions_per_step(zero_stage, microbatches):
    """How many times a step reduces the gradients under gradient accumulation: ZeRO-0/1 once,
    after the last micro-batch (each rank accumulates its full gradients, then all-reduces or
    reduce-scatters them); ZeRO-2 after every micro-batch's backward, because a rank keeps only
    its shard of the accumulated gradients and must hand every other shard on before the next
    backward adds to it (DeepSpeed issue #2252: "For zero stage 2 (and 3), gradient reduction
    is required after every backward because of gradient partitioning"). ZeRO-3's per-layer
    traffic is fsdp_traffic's, per micro-batch too."""
    return microbatches if zero_stage == 2 else 1


def dp_traffic_bytes(stage_params, zero_stage, shard, weight_bytes=2):
    """{op: payload bytes} of one DP collective of each kind on a stage (dp_traffic's): ZeRO-0
    one all-reduce of the fp32 gradients; ZeRO-1/2 their reduce-scatter and an all-gather of
    each rank's shard of the updated weights. Per step the all-gather runs once, the
    gradient reduction grad_reductions_per_step times (ZeRO-2: once per micro-batch)."""
    grads = GRAD_BYTES * stage_params
    if zero_stage == 0:
        return {"all_reduce": grads}
    return {"reduce_scatter": grads, "all_gather": weight_bytes * stage_params / shard}


def fsdp_traffic_bytes(stage_params, shard, weight_bytes=2):
    """{op: payload bytes} of one micro-batch's ZeRO-3 collectives on a stage (fsdp_traffic's):
    each rank's weight shard gathered twice (forward, backward), the fp32 gradients
    reduce-scattered once; all_gather's payload is per gather (two of them)."""
    return {"all_gather": weight_bytes * stage_params / shard,
            "reduce_scatter": GRAD_BYTES * stage_params}


def dp_traffic(c, stage_params, zero_stage, shard, span, weight_bytes=2):
    """(gradient reduction, parameter all-gather, bucket share) seconds of ONE of each
    collective over `shard` ranks: ZeRO-0 all-reduces fp32 gradients; ZeRO-1/2 reduce-scatter
    them and all-gather the updated bf16 weights. A step runs the reduction
    grad_reductions_per_step times (ZeRO-2: per micro-batch), the all-gather once; ZeRO-3's
    per-layer traffic is fsdp_traffic's."""
    grads = GRAD_BYTES * stage_params
    link = c.ring_link(shard, span)
    payload = dp_traffic_bytes(stage_params, zero_stage, shard, weight_bytes)
    reduce_op = "all_reduce" if zero_stage == 0 else "reduce_scatter"
    reduce_s = collective_time(reduce_op, payload[reduce_op], shard, link)
    gather_s = collective_time("all_gather", payload["all_gather"], shard, link) \
        if zero_stage else 0.0
    bucket_share = min(1.0, BUCKET_BYTES / max(grads, 1))
    return reduce_s, gather_s, bucket_share


def fsdp_traffic(c, stage_params, shard, span, weight_bytes=2):
    """(gather, reduce) seconds per micro-batch of ZeRO-3 / FSDP on one stage: every weight
    gathered before forward and again before backward, every gradient reduce-scattered (fp32)."""
    link = c.ring_link(shard, span)
    payload = fsdp_traffic_bytes(stage_params, shard, weight_bytes)
    gather = 2 * collective_time("all_gather", payload["all_gather"], shard, link)
    reduce = collective_time("reduce_scatter", payload["reduce_scatter"], shard, link)
    return gather, reduce


def optimizer_time(c, params_held):
    """Adam is memory bound: ADAM_BYTES_TOUCHED bytes per parameter a GPU updates / achievable
    HBM bandwidth (kernels.hbm_bandwidth)."""
    return ADAM_BYTES_TOUCHED * params_held / kernels.hbm_bandwidth(c.gpu)


def elementwise_time(c, work, layers, recompute_share, selective=False):
    """Memory-bound element-wise kernels (norms, rotary, activations, residual adds, dropout,
    an unfused softmax) at the achievable HBM bandwidth (kernels.hbm_bandwidth), from their own
    bytes (kernels.layer_kernels, `work` = kernels.training_forward's answer), not a fitted
    pass count. Per layer and micro-batch:
        bytes = forward + backward + recompute_share x forward (+ the softmax's forward again
                under selective recompute)
    Forward: each kernel reads its inputs and writes its output once. Backward, derived per
    kernel (kernels.elementwise): y = f(x_1..x_n) needs dy and the saved x_i and writes each
    dx_i, so it moves (2n + 1) / (n + 1) of the forward's bytes (a norm 3a for 2a, SwiGLU
    5 for 3, softmax 3 for 2); a linear map (rotary, a residual add, a permutation) moves the
    gradient as the forward moved the value; dropout reads the gradient and its 1-byte mask.
    Once per micro-batch, the head's: the final norm and the cross entropy over the rank's
    logits, 38 + 14 bytes per logit (kernels.LOSS_FORWARD_BYTES: Megatron-Core's fp32 loss).
    Hand check (Llama 3 8B, 8192 tokens, tp=1, a = 2 x 8192 x 4096 B = 64 MiB): norms 2 x (2a
    + 3a), residuals 2 x (3a + 3a), rotary 2 x 2 x 1.25a (q and k: 40 of 32 heads' width),
    SwiGLU (3 + 5) x 3.5a (ffn 14336 = 3.5 h): 55a = 3.69 GB per layer and micro-batch. The
    fitted constant this replaces (6.5 passes over the bytes a layer keeps, Narayanan et al.
    2021 Table 1) is gone: nothing here is fitted to a published run."""
    per_layer = work["forward_bytes"] * (1 + recompute_share) + work["backward_bytes"]
    if selective:
        per_layer += (1 - recompute_share) * work["softmax_bytes"]
    return (layers * per_layer + work["head_bytes"]) / kernels.hbm_bandwidth(c.gpu)


def fp8_cast_time(c, m, tokens, tp, layers, layer_params, microbatches):
    """Transformer Engine casts each fp8 GEMM's inputs: forward activations entering the QKV,
    output, MLP-up and MLP-down projections (3h + f per token), their gradients in backward
    (as many), FP8_CAST_BYTES each; weights once per step (cached across micro-batches).
    Current scaling reads each bf16 value once more (CURRENT_SCALING_BYTES) for its amax: "FP8
    Current Scaling requires two tensor reads per quantization: one to compute amax, one to
    cast" (Transformer Engine docs, "FP8 Delayed Scaling"); delayed scaling takes the amax
    from history.
    Hand check: h=4096, f=14336, 8192 tokens, tp=1, 1 layer: 2 * 8192 * 26624 * 4 B = 1.74 GB
    of HBM traffic per micro-batch."""
    f = m.ffn * (min(m.top_k, m.experts) if m.experts > 1 else 1)
    cast = FP8_CAST_BYTES + (CURRENT_SCALING_BYTES if c.fp8_recipe == "current" else 0)
    per_mb = 2 * tokens * (3 * m.hidden + f) / tp * layers * cast
    weights = layer_params * layers * cast
    return (per_mb * microbatches + weights) / kernels.hbm_bandwidth(c.gpu)


