"""The planner: which DP x TP x PP (x CP, EP) layouts of a model fit a cluster, and how fast.

For a model, a cluster and a global batch it enumerates every legal plan (dp, tp, pp, cp, ep,
interleave v, micro-batch size, ZeRO stage 0-3, recompute none/selective/full of k layers per
stage, sequence parallel), predicts memory per GPU (worst pipeline stage) and the step time, and
ranks the plans that fit. Everything is modelled from first principles with named terms
(plan_terms.py, recompute.py, overlap.py, kernels.py); one number is fitted, on the declared
calibration rows only (kernels.IN_STEP_GEMM_FRACTION, published.fit_in_step_gemm_fraction):

- Compute: kernel by kernel (kernels.py): each forward kernel of a layer the max of its FLOPs at
  peak x the GPU's measured MAMF ceiling x its shape's tile and wave quantization and its bytes
  at an achievable HBM bandwidth, plus a launch; backward as its own kernels (dgrad and wgrad
  GEMMs at their own shapes, FlashAttention's backward at 2.5 x its forward's FLOPs);
  recompute runs the forward again; linear layers at the fp8 peak under precision="fp8";
  attention at half its FLOPs under FlashAttention with a causal mask (the kernel skips masked
  blocks). Element-wise kernels (norms, rotary, activations, residual adds, dropout, an unfused
  softmax, the fp32 cross entropy over the logits) at their own bytes forward and backward
  (plan_terms.elementwise_time). MFU counts
  the FLOPs the model needs (6 N + 6 L h s per token when causal: the masked scores are not
  needed), HFU those the kernels run (with recompute), both over the dense peak of the linear
  layers' precision: each <= 1.
- Memory, Megatron-LM's convention: 18 bytes per parameter (bf16 weights 2, fp32 main gradients
  4, fp32 master weights + Adam moments 12; ZeRO's paper counts 16 with bf16 gradients), sharded
  by ZeRO through memory.model_state_bytes; activations per layer from transformer.py times the
  micro-batches a stage holds (recompute.py, with k of the layers fully recomputed); two
  gathered layers under ZeRO-3; the allocator reserve (plan_terms.ALLOCATOR_RESERVE).
- Time: compute + recompute + element-wise kernels + TP collectives + CP's K/V ring (each hop
  under one layer's attention block; exposed where the stack all-gathers, "llama3") + the pipeline
  bubble (pp-1)/v micro-batch times (Narayanan et al. 2021) + pipeline sends + DP/ZeRO traffic
  (ZeRO-0/1 reduce the gradients once per step, ZeRO-2 after every micro-batch's backward:
  plan_terms.grad_reductions_per_step) + the experts' all-to-alls (exposed) + the optimizer (memory
  bound); messages carry values of the run's precision (plan_terms.message_bytes). Each
  communication is split into what the stack (overlap.py: megatron, megatron-2021, fsdp2, deepspeed,
  llama3) hides under compute and what stays exposed; hidden traffic slows compute by the SMs it
  holds (overlap.COMM_SMS). Collectives use the alpha-beta ring model (time.py) on NVLink inside a
  node, the inter-node link across nodes.
- Legal interleaving: v > 1 needs whole layers per virtual stage (layers % (pp v) == 0).

Left out (so errors can be read): Python overheads, load imbalance between MoE experts, the
embedding's all-reduce across the first and last stage, network contention between concurrent
groups, stragglers and failures, GEMM shapes that fall short of the best matmul for reasons other
than tile and wave quantization.
"""
from __future__ import annotations

import functools

from . import kernels, overlap, plan_inputs as inputs, plan_terms as terms
from . import recompute as rc
from . import transformer as tf
from .plan_cluster import ClusterSpec, achievable_fraction, make_cluster  # noqa: F401
from .plan_space import (MICRO_BATCHES, candidates, interleave_choices,  # noqa: F401
                         layers_per_stage, why_illegal, zero3_with_pipeline)

RECOMPUTE = inputs.RECOMPUTE
FIELDS = inputs.FIX_FIELDS
SHAPE_KEYS = inputs.SHAPE_KEYS
RESERVED_BYTES = terms.ALLOCATOR_RESERVE
# Per-model quantities the search asks for thousands of times (ModelShape is hashable).
_cached = functools.lru_cache(maxsize=256)
layer_counts, model_flops_per_token = _cached(tf.layer_counts), _cached(tf.model_flops_per_token)
layer_forward_flops = _cached(tf.layer_forward_flops_per_token)
activation_bytes = _cached(tf.activation_bytes)


def activation_terms(m, c, seq, p):
    """One layer's bytes kept (a_none), kept when recomputed (a_full), the rebuilt working set,
    and the last stage's logits, for one micro-batch on one GPU."""
    mbs, tp, cp, sp = p["micro_batch_size"], p["tp"], p["cp"], p["sequence_parallel"]
    flash, value_bytes = c.flash_attention, terms.message_bytes(c.precision)
    none = activation_bytes(m, seq, mbs, tp, sp, "none", cp, flash, c.dropout, value_bytes)
    kept = none if p["recompute"] != "selective" else \
        activation_bytes(m, seq, mbs, tp, sp, "selective", cp, flash, c.dropout, value_bytes)
    full = activation_bytes(m, seq, mbs, tp, sp, "full", cp, flash, c.dropout, value_bytes)
    # the working set of a layer being recomputed is what it keeps without recompute
    return dict(kept_layer=kept, recomputed_layer=full, working_set=none,
                logits=tf.logits_bytes(m, seq, mbs, tp, cp))


def memory_terms(m, c, batch, seq, p):
    """Memory per GPU of the worst stage, and the plan with `recompute_layers` settled: under
    recompute="full" with recompute_layers None, the fewest layers per stage that fit."""
    layers = layers_per_stage(m, p["pp"])
    stage_params, layer_params = terms.stage_parameters(m, p["tp"], p["ep"], p["pp"], layers)
    shard = p["dp"] * p["cp"]        # ZeRO shards over every rank holding the same weights
    experts = terms.expert_parameters(m, p["tp"], p["ep"], layers)   # over shard / ep of them
    states = terms.sharded_states(stage_params, experts, c.precision, p["zero_stage"], shard,
                                  p["ep"])
    weight_bytes = terms.message_bytes(c.precision)
    buffers = terms.zero3_buffers(layer_params, p["zero_stage"], weight_bytes)
    stage = dict(activation_terms(m, c, seq, p), microbatches=batch // (p["dp"] *
                 p["micro_batch_size"]), pp=p["pp"], v=p["v"])
    k = p["recompute_layers"]
    if p["recompute"] != "full":
        # selective recompute rebuilds only the attention scores: no layer is recomputed
        # whole, each keeps a_selective (kept_layer above; Korthikanti et al. 2022, Sec. 4.2)
        k = 0
    elif k is None:
        budget = c.usable_bytes - states["total"] - buffers
        k = rc.least_recompute_layers(budget, layers, **stage)
    activations = rc.stage_activation_bytes(layers_per_stage=layers, recompute_layers=k,
                                            selective=p["recompute"] == "selective", **stage)
    mem = dict(params=states["params"], grads=states["grads"], optimizer=states["optimizer"],
               activations=activations, buffers=buffers, reserved=terms.ALLOCATOR_RESERVE)
    mem["total"] = sum(mem.values())
    return mem, dict(p, recompute_layers=k), stage_params, stage["working_set"]


def evaluate(m, c, batch, seq, p):
    """Memory per GPU and modelled step time of one legal plan (a plan dict, as in `plan`)."""
    return finish(m, c, batch, seq, *memory_terms(m, c, batch, seq, p))


def finish(m, c, batch, seq, mem, p, stage_params, layer_bytes_kept):
    """The plan dict from memory_terms' answer: step time, MFU, HFU, throughput."""
    breakdown, communication = step_terms(m, c, batch, seq, p, stage_params, layer_bytes_kept)
    explained = communication.pop("explain")
    step = sum(breakdown.values())
    model_flops = batch * seq * model_flops_per_token(m, seq, c.causal)
    hw_flops = batch * seq * hardware_flops_per_token(m, c, seq, p)
    fits = mem["total"] <= c.capacity_bytes
    peak = mfu_peak_flops(c)
    return dict(
        p, layers_per_stage=layers_per_stage(m, p["pp"]), stack=c.stack.name,
        precision=c.precision, microbatches=batch // (p["dp"] * p["micro_batch_size"]),
        fits=fits, reason="" if fits else (f"needs {mem['total'] / 1e9:.1f} GB per GPU > "
                                           f"{c.capacity_bytes / 1e9:.1f} GB on {c.gpu.name}"),
        memory_bytes=mem, step_s=step, breakdown_s=breakdown, explain_s=explained,
        communication_s=communication,
        mfu=model_flops / (step * c.gpus * peak), hfu=hw_flops / (step * c.gpus * peak),
        tokens_per_s_per_gpu=batch * seq / step / c.gpus,
        model_tflops_per_gpu=model_flops / step / c.gpus / 1e12)


def mfu_peak_flops(c):
    """MFU's and HFU's denominator per GPU: the dense peak of the precision the linear layers
    run at (fp8 under precision="fp8", else bf16), so that neither can pass 1."""
    return c.gpu.flops("fp8") if c.precision == "fp8" else c.gpu.bf16_flops


def hardware_flops_per_token(m, c, seq, p):
    """FLOPs the GPUs execute per token (HFU's numerator): the linear layers and the head
    (6 per weight), the attention core at the share the kernel runs (plan_terms.
    attention_time_factor: half under FlashAttention with a causal mask, all of it unfused),
    and what recompute runs again (recompute.recompute_flops, attention at the same share)."""
    factor = terms.attention_time_factor(c.flash_attention, c.causal)
    core = tf.attention_core_flops_per_token(m, seq)
    linear = layer_forward_flops(m, seq) - core
    per_layer = 3 * linear + 3 * core * factor
    extra = rc.recompute_flops(linear + core * factor, core * factor, p["recompute"],
                               p["recompute_layers"], layers_per_stage(m, p["pp"]),
                               c.flash_attention)
    return m.layers * (per_layer + extra) + tf.head_flops_per_token(m)


def step_terms(m, c, batch, seq, p, stage_params, layer_bytes_kept):
    """(seconds per step on the slowest stage by term, communication split per dimension into
    `*_exposed`, on the critical path and in the first dict under its plain name, and
    `*_hidden`, under compute)."""
    dp, tp, pp, cp, v = (p[k] for k in ("dp", "tp", "pp", "cp", "v"))
    micro, layers = batch // (dp * p["micro_batch_size"]), layers_per_stage(m, pp)
    tokens = p["micro_batch_size"] * seq / cp
    share = p["recompute_layers"] / layers if p["recompute"] == "full" else 0.0
    work = _micro_batch_work(m, c, seq, p, tokens, layers, share, layer_bytes_kept)
    st, vb = c.stack, terms.message_bytes(c.precision)   # messages at the run's precision
    calls = terms.tp_collectives_per_layer(p["recompute"], share)    # TP's, and EP's
    tp_total = terms.tp_comm_time(c, m, tokens, tp, layers, calls, vb)
    tp_exp, tp_hid = overlap.tp_comm(st, tp_total, work["gemm"], tp) if \
        p["sequence_parallel"] else (tp_total, 0.0)
    # each ring hop hides under one layer's block of attention, not the stage's
    cp_total, cp_exp = terms.cp_ring_times(c, m, seq, tokens, tp, cp, layers,
                                           work["attention"] / layers, vb, share)
    if not st.cp_overlap:     # K and V all-gathered before attention, on the critical path
        cp_exp = cp_total
    ep_s = terms.ep_comm_time(c, m, tokens, p["ep"], layers, p["ep"] * cp * tp, calls, vb)
    sms = kernels.sms(c.gpu)
    slow_mb = overlap.contention_slowdown(tp_hid + cp_total - cp_exp, sms)
    mb_time = work["total"] + tp_exp + cp_exp + ep_s + slow_mb
    pp_total = terms.pp_send_time(c, m, tokens, tp, dp * cp * tp * 2, pp, micro, v, vb)
    pp_exp, pp_hid = overlap.pp_sends(st, pp_total, v)
    dp_exp, dp_hid = _dp_comm(c, p, stage_params, work, micro, layers, vb)
    # ZeRO steps 1/(dp cp) of the dense weights, 1/(dp cp / ep) of the experts (their replicas)
    experts = terms.expert_parameters(m, tp, p["ep"], layers) if p["zero_stage"] >= 1 else 0
    opt_params = (stage_params - experts) / (dp * cp if p["zero_stage"] >= 1 else 1) \
        + experts / (dp * cp // p["ep"])
    out = dict(compute=micro * (work["compute"] + work["elementwise"] + work["fp8_cast"]),
               recompute=micro * work["recompute"],
               tp_comm=micro * tp_exp, cp_comm=micro * cp_exp, ep_comm=micro * ep_s,
               pp_bubble=(pp - 1) / v * mb_time,
               pp_comm=pp_exp, dp_comm=dp_exp, optimizer=terms.optimizer_time(c, opt_params),
               overlap_slowdown=micro * slow_mb + overlap.contention_slowdown(pp_hid + dp_hid,
                                                                                  sms))
    explained = dict(gemm=micro * (work["gemm"] + work["head"]),
                     attention_forward=micro * work["attention_forward"],
                     attention_backward=micro * work["attention_backward"],
                     elementwise=micro * (work["elementwise"] + work["fp8_cast"]),
                     launches=micro * work["launches"],
                     **{k: v for k, v in out.items() if k != "compute"})
    communication = dict(explain=explained,
                         tp_comm_exposed=micro * tp_exp, tp_comm_hidden=micro * tp_hid,
                         cp_comm_exposed=micro * cp_exp,
                         cp_comm_hidden=micro * (cp_total - cp_exp), pp_comm_exposed=pp_exp,
                         pp_comm_hidden=pp_hid, dp_comm_exposed=dp_exp, dp_comm_hidden=dp_hid,
                         ep_comm_exposed=micro * ep_s, ep_comm_hidden=0.0)
    return out, communication


def _micro_batch_work(m, c, seq, p, tokens, layers, share, kept):
    """Seconds of one micro-batch's compute on one stage, kernel by kernel (kernels.py): linear
    layers (at the precision's rate), attention core and head (bf16), each forward x 3 for
    forward + backward; the launches of every kernel; recompute; element-wise passes; fp8
    casts."""
    tp, flash = p["tp"], c.flash_attention
    mbs = p["micro_batch_size"]
    fwd = kernels.training_forward(
        m, tokens, seq, c.gpu, tp, p["ep"], mbs, c.causal, flash,
        terms.message_bytes(c.precision), terms.gemm_flops_rate(c, c.precision),
        c.gpu.bf16_flops * c.achievable, c.kernel_launch_s, p["sequence_parallel"],
        tf.is_gpt(m) if c.dropout is None else c.dropout, p["cp"], c.in_step_gemm_fraction)
    gemm = layers * (fwd["gemm"] + fwd["gemm_backward"])
    attention = layers * (fwd["attention"] + fwd["attention_backward"])
    head = fwd["head"] + fwd["head_backward"]
    launches = layers * (fwd["launch"] + fwd["backward_launch"]) + 3 * fwd["head_launch"]
    # run again in backward: the whole forward of the fully recomputed share (its launches
    # too); the scores under selective recompute (FlashAttention's backward kernel already
    # recomputes them: kernels.backward)
    core_again = layers * fwd["attention"] if (not flash and p["recompute"] == "selective") \
        else 0.0
    # the element-wise kernels run again (the recomputed layers' forward, the unfused softmax
    # under selective recompute) are recompute's too, not the step's own compute
    elementwise = terms.elementwise_time(c, fwd, layers, 0.0)
    again = terms.elementwise_time(c, fwd, layers, share,
                                   p["recompute"] == "selective" and not flash) - elementwise
    recompute_s = share * layers * (fwd["gemm"] + fwd["attention"] + fwd["launch"]) \
        + (1 - share) * core_again + again
    cast = 0.0
    if c.precision == "fp8":
        counts = layer_counts(m)
        counts_layer = (counts.attention + counts.mlp_active) / tp
        cast = terms.fp8_cast_time(c, m, tokens, tp, layers, counts_layer, 1)
    compute = gemm + attention + head + launches
    return dict(gemm=gemm, attention=attention, compute=compute, recompute=recompute_s,
                elementwise=elementwise, fp8_cast=cast, head=head, launches=launches,
                attention_forward=layers * fwd["attention"],
                attention_backward=layers * fwd["attention_backward"],
                total=compute + recompute_s + elementwise + cast)


def _dp_comm(c, p, stage_params, work, micro, layers, weight_bytes):
    """(exposed, hidden) seconds of data-parallel traffic per step (overlap.py by stack): the
    gradient reduction once (ZeRO-0/1) or per micro-batch (ZeRO-2), the all-gather once."""
    shard, zero, st = p["dp"] * p["cp"], p["zero_stage"], c.stack
    span = p["dp"] * p["cp"] * p["tp"]
    forward = work["compute"] / 3
    backward = work["compute"] - forward + work["recompute"]
    if zero == 3:
        gather, reduce = terms.fsdp_traffic(c, stage_params, shard, span, weight_bytes)
        exposed, hidden = overlap.fsdp_layer_traffic(gather, reduce, forward, backward, layers)
        return micro * exposed, micro * hidden
    reduce_s, gather_s, bucket = terms.dp_traffic(c, stage_params, zero, shard, span,
                                                  weight_bytes)
    # ZeRO-2 reduce-scatters after every micro-batch (it keeps only its gradient shard)
    r_exp, r_hid = overlap.dp_grad_reduce(st, reduce_s, backward, bucket * reduce_s, zero,
                                          terms.grad_reductions_per_step(zero, micro))
    g_exp, g_hid = overlap.dp_param_gather(st, gather_s, forward, bucket * gather_s)
    return r_exp + g_exp, r_hid + g_hid


parse_fix = inputs.parse_fix          # 'dp=64,tp=8,recompute=full' -> {field: value}
parse_model = inputs.parse_model      # a catalog name, a ModelShape or a shape string, checked


def plan(model, gpus, gpu="H100", gpus_per_node=None, intra_link=None, inter_link=None,
         global_batch=None, global_batch_tokens=None, seq=4096, fix=None, top=None,
         achievable=None, flash_attention=True, precision="bf16",
         dropout=None, stack=None, causal=True, fp8_recipe="delayed",
         in_step_gemm_fraction=None):
    """Rank every legal plan; returns {"model", "cluster", "considered", "plans"}.

    flash_attention=False models a stack that stores the softmax (Megatron-LM in 2021);
    precision "fp8" runs the linear layers in fp8 (Transformer Engine), "fp32" is all fp32 (4 +
    4 + 8 bytes of Adam states per parameter); fp8_recipe: Transformer Engine's "delayed" or
    "current" scaling (plan_terms.fp8_cast_time); stack: overlap.STACKS (default "megatron");
    gpu: a catalog name or a hardware.GPU (hardware.custom_gpu); in_step_gemm_fraction: the
    in-step GEMM factor (None: data/kernels.csv's, kernels.IN_STEP_GEMM_FRACTION)."""
    m = parse_model(model)
    c = make_cluster(gpu, gpus, gpus_per_node, intra_link, inter_link, achievable,
                     flash_attention, precision, dropout, stack, causal, fp8_recipe,
                     in_step_gemm_fraction)
    seq = inputs.count("seq", seq)
    note = ""
    if global_batch is None:
        if global_batch_tokens is None:
            raise ValueError("give the global batch in sequences or in tokens")
        tokens = inputs.count("global_batch_tokens", global_batch_tokens)
        if tokens < seq:
            raise ValueError(f"--global-batch-tokens {tokens} is less than one sequence of "
                             f"{seq} tokens")
        global_batch = tokens // seq
        if tokens % seq:
            note = (f"--global-batch-tokens {tokens:,} is not a whole number of {seq:,}-token "
                    f"sequences: rounded down to {global_batch:,} sequences "
                    f"({global_batch * seq:,} tokens)")
    global_batch = inputs.count("global_batch", global_batch)
    top = None if top is None else inputs.count("top", top)
    fix = parse_fix(fix)
    legal, reasons = [], set()
    for p in candidates(m, c, global_batch, seq, fix):
        why = why_illegal(m, c, global_batch, seq, dict(p, recompute_layers=p["recompute_layers"]
                                                         or 0))
        if why:
            reasons.add(why)
            continue
        settled = memory_terms(m, c, global_batch, seq, p)
        if p["recompute"] == "full" and settled[1]["recompute_layers"] == 0 \
                and "recompute" not in fix:
            continue            # the same plan as recompute="none"
        legal.append(finish(m, c, global_batch, seq, *settled))
    if not legal:
        raise ValueError(f"no legal plan for {m.display_name} on {c.gpus} {c.gpu.name}"
                         + (f" with {fix}" if fix else "") + ": " + "; ".join(sorted(reasons)[:3]))
    legal.sort(key=lambda r: (not r["fits"], r["step_s"] if r["fits"]
                              else r["memory_bytes"]["total"]))
    return dict(model=dict(name=m.name, display_name=m.display_name,
                           params=m.param_count(), active_params=m.active_param_count()),
                cluster=dict(gpu=c.gpu.name, gpus=c.gpus, gpus_per_node=c.gpus_per_node,
                             intra_link=c.intra.name, inter_link=c.inter.name,
                             achievable=c.achievable, usable_bytes=c.usable_bytes,
                             capacity_bytes=c.capacity_bytes, stack=c.stack.name,
                             precision=c.precision, flash_attention=c.flash_attention,
                             causal=c.causal),
                workload=dict(global_batch=global_batch, seq=seq, note=note),
                considered=len(legal), plans=legal[:top] if top else legal)


def recompute_label(p):
    """'none', 'selective', 'full' (every layer) or 'full 3/16' (3 of a stage's 16 layers)."""
    if p["recompute"] != "full":
        return p["recompute"]
    per_stage = p.get("layers_per_stage") or p["recompute_layers"]
    return "full" if p["recompute_layers"] >= per_stage else \
        f"full {p['recompute_layers']}/{per_stage}"


# `plan --explain`: the best plan's step by kernel class and by what is exposed (explain_s)
EXPLAIN = (("gemm", "GEMMs: linear layers and logits, forward + backward"),
           ("attention_forward", "attention forward"),
           ("attention_backward", "attention backward"),
           ("elementwise", "element-wise: norms, rotary, activations, residuals, loss, casts"),
           ("launches", "kernel launches"),
           ("recompute", "recompute (forward run again in backward)"),
           ("optimizer", "optimizer step (Adam, memory-bound)"),
           ("tp_comm", "exposed TP communication"), ("cp_comm", "exposed CP communication"),
           ("ep_comm", "exposed EP communication"), ("pp_comm", "exposed PP sends"),
           ("dp_comm", "exposed DP / ZeRO communication"),
           ("pp_bubble", "pipeline bubble"),
           ("overlap_slowdown", "compute slowed by SMs lent to hidden communication"))


def format_explain(p):
    """The plan's step split into its parts (explain_s), each with its share: the parts add
    up to the step; every number modelled."""
    parts = p["explain_s"]
    lines = [f"the step of dp={p['dp']} tp={p['tp']} pp={p['pp']} cp={p['cp']} ep={p['ep']} "
             f"v={p['v']}, {p['step_s']:.3f} s (modelled), by part:",
             f"  {'part':<66} {'seconds':>9} {'share':>6}"]
    for key, label in EXPLAIN:
        lines.append(f"  {label:<66} {parts[key]:9.4f} {parts[key] / p['step_s']:6.1%}")
    return "\n".join(lines)
