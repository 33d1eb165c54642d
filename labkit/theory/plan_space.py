"""The planner's search space: which layouts of a model on a cluster are legal, and the order
they are visited in.

A layout is (dp, tp, pp, cp, ep, v, micro-batch size, ZeRO stage, recompute, sequence
parallelism) with dp x tp x pp x cp = GPUs. Legal means the degrees split what they split: tp the
heads (and kv heads) and the ffn, pp the layers (v > 1: whole layers per virtual stage,
Narayanan et al. 2021, arXiv 2104.04473), dp x micro-batch the global batch, 2 cp the sequence
(zigzag chunks), ep the experts and dp; ZeRO-2/3 with PP only where a real stack runs it
(FSDP2's ZeRO-3); SP only with tp > 1. `why_illegal` names the first rule a layout breaks, so
`plan --fix` can answer in one line; `candidates` yields the layouts the search prices
(planner.evaluate).
"""
from __future__ import annotations

import functools
import itertools

from . import plan_inputs as inputs

MICRO_BATCHES = (1, 2, 4, 8, 16)
RECOMPUTE = inputs.RECOMPUTE


def layers_per_stage(m, pp):
    """Layers on the fullest stage (uneven splits put the extra layers on some stages)."""
    return -(-m.layers // pp)


@functools.lru_cache(maxsize=1024)
def interleave_choices(m, pp):
    """Every legal v for pp stages: v > 1 needs whole layers per virtual stage, the layers alone
    (layers % (pp v) == 0) or with the embedding and the loss each taking one layer's slot on
    the first and last stage (Megatron-LM's --account-for-embedding/loss-in-pipeline-split,
    as Llama 3.1 405B's 126 layers on 8 or 16 stages)."""
    if pp <= 1:
        return [1]
    out = {1}
    for slots in (m.layers, m.layers + 2):
        if slots % pp == 0:
            out.update(inputs.divisors(slots // pp))
    return sorted(out)


def zero3_with_pipeline(c, zero_stage):
    """ZeRO-3 composes with PP on the fsdp2 stack only: torchtitan applies fully_shard to each
    pipeline stage (Liang et al. 2024, TorchTitan, arXiv 2410.06511). Modelled as labkit's mesh
    runs it: each stage's weights gathered and its gradients reduce-scattered per micro-batch
    (fully_shard's reshard_after_forward=True; torchtitan's default for PP keeps the weights
    unsharded over the micro-batches instead: fewer gathers, a whole stage's weights in memory).
    Megatron-LM and DeepSpeed refuse ZeRO-2/3 with PP."""
    return zero_stage == 3 and c.stack.name == "fsdp2"


def why_illegal(m, c, batch, seq, p):
    """'' if plan `p` is a legal layout of model `m` on cluster `c`, else the reason."""
    dp, tp, pp, cp, ep, v, mbs = (p[k] for k in ("dp", "tp", "pp", "cp", "ep", "v",
                                                 "micro_batch_size"))
    if dp * tp * pp * cp != c.gpus:
        return f"dp*tp*pp*cp = {dp * tp * pp * cp}, not the {c.gpus} GPUs"
    if m.heads % tp or (m.kv_heads % tp and tp % m.kv_heads):
        return f"tp={tp} does not split {m.heads} heads / {m.kv_heads} kv heads"
    if m.ffn % tp:
        return f"tp={tp} does not divide ffn={m.ffn}"
    if pp > m.layers:
        return f"pp={pp} > {m.layers} layers"
    if v > 1 and (pp == 1 or v not in interleave_choices(m, pp)):
        return (f"v={v} needs pp > 1 and whole layers per virtual stage ({m.layers} layers "
                f"do not split into pp*v = {pp * v} chunks)")
    if batch % (dp * mbs):
        return f"global batch {batch} does not split into dp={dp} x micro-batch {mbs}"
    if v > 1 and (batch // (dp * mbs)) % pp:
        return "interleaving needs micro-batches divisible by pp"
    if p["zero_stage"] >= 2 and pp > 1 and not zero3_with_pipeline(c, p["zero_stage"]):
        return (f"ZeRO-{p['zero_stage']} with pipeline parallelism on stack {c.stack.name} "
                "(Megatron-LM and DeepSpeed refuse it; FSDP2 runs ZeRO-3 with PP)")
    if p["sequence_parallel"] and tp == 1:
        return "sequence parallelism needs tp > 1"
    if cp > 1 and seq % (2 * cp):
        return f"sequence {seq} does not split into 2*cp={2 * cp} chunks"
    if m.experts > 1 and (m.experts % ep or dp % ep):
        return f"ep={ep} must divide experts={m.experts} and dp={dp}"
    if m.experts <= 1 and ep > 1:
        return "ep > 1 needs a mixture-of-experts model"
    if p["recompute_layers"] > layers_per_stage(m, pp):
        return f"recompute_layers={p['recompute_layers']} > {layers_per_stage(m, pp)} per stage"
    return ""


def candidates(m, c, batch, seq, fix=None):
    """Every plan (dict of FIELDS) the search visits, `fix`ed fields held. Under FlashAttention
    selective recompute is what the kernel already does: the search visits "none" for it. A
    searched full recompute leaves recompute_layers None (evaluate picks the fewest layers
    that fit); recompute="full" fixed without recompute_layers means every layer."""
    fix = dict(fix or {})
    rcs = ("none", "full") if c.flash_attention else RECOMPUTE
    gpu_divisors = inputs.divisors(c.gpus)
    pow2 = [d for d in gpu_divisors if d & (d - 1) == 0]

    def pick(key, default):
        return [fix[key]] if key in fix else default
    for tp in pick("tp", [d for d in pow2 if d <= m.heads]):
        for cp in pick("cp", [d for d in pow2 if d <= 32] if seq >= 32768 else [1]):
            rest = c.gpus // (tp * cp) if c.gpus % (tp * cp) == 0 else 1
            for pp in pick("pp", [d for d in inputs.divisors(rest) if d <= m.layers]):
                dp = fix.get("dp", c.gpus // (tp * cp * pp))
                eps = [e for e in inputs.divisors(m.experts) if dp % e == 0] \
                    if m.experts > 1 else [1]
                chunks = interleave_choices(m, pp)
                for ep, v, mbs in itertools.product(pick("ep", eps), pick("v", chunks),
                                                    pick("micro_batch_size", MICRO_BATCHES)):
                    zeros = pick("zero_stage", (0, 1, 2, 3) if pp == 1 else
                                 (0, 1, 3) if zero3_with_pipeline(c, 3) else (0, 1))
                    sps = pick("sequence_parallel", (False, True) if tp > 1 else (False,))
                    for zero, rc_mode, sp in itertools.product(zeros, pick("recompute", rcs),
                                                               sps):
                        # recompute="full" asked for: every layer; searched: the fewest that fit
                        every = layers_per_stage(m, pp) if "recompute" in fix else None
                        k = fix.get("recompute_layers", every) if rc_mode == "full" else 0
                        if rc_mode == "none" and fix.get("recompute_layers"):
                            continue      # recompute_layers=k > 0 means full recompute of k
                        yield dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, v=v,
                                   micro_batch_size=mbs, zero_stage=zero, recompute=rc_mode,
                                   recompute_layers=k, sequence_parallel=sp)
