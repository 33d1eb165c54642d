"""The planner's side of a plan run in miniature (runs/miniature.py): the tiny shape a plan
scales down to, and what the planner's own functions say for it, plus the derived differences.

Scaling rule (`miniature_shape`): the degrees are kept, the sizes shrink while keeping every
divisibility the layout needs: heads = 2 tp (whole heads per TP rank), hidden = 8 heads, ffn =
4 hidden and vocab = 32 tp (split by TP), seq = 8 tp cp (each CP rank holds 8 tp tokens, 2 whole
zigzag chunks, split by SP), layers the fewest (>= 2)
with (layers + 2) % (pp v) == 0 (the mesh's embeddings and head are stages of their own:
every virtual stage then has whole units) and, where one exists, layers % pp == 0,
micro-batches max(2, pp) (the interleaved schedule needs a multiple of pp), global batch
dp x micro-batches x micro-batch size (<= 2), experts 2 ep (top-2). The tiny model trains in
fp32, so the planner is asked with precision="fp32", no FlashAttention and no dropout, as the
tiny GPT runs.

Where the planner and the mesh legitimately differ, the difference is derived, named and added
to the planner's number (`adjusted`), never fitted:
- row-parallel biases (attention output, MLP down) are replicated on every TP rank, the
  planner divides all of a layer's weights by tp: + 2 h (1 - 1/tp) per layer held; with
  experts (expert TP, parallel/expert_tp.py) each local expert's down bias: + (1 + E/ep) h
  (1 - 1/tp), of which E/ep h (1 - 1/tp) are the experts' (averaged over ep_dp);
- the learned position table is split by TP only under SP (else replicated): + s h (1 - 1/tp)
  on the rank holding the embedding; the final LayerNorm has a bias the planner (RMSNorm-like
  `head_params`) leaves out, and the norm is whole on every TP rank: + 2h - h/tp on the rank
  holding the head;
- the mesh splits layers + 2 units (embedding, blocks, head) evenly, the planner puts
  ceil(layers / pp) blocks plus the larger end on its worst stage: the rank's own blocks and
  ends, counted by the planner's per-layer and per-end numbers;
- bytes: the planner's TP term counts the 4 collectives per layer and micro-batch; the mesh's
  vocabulary-parallel embedding (an all-reduce forward), head (an all-reduce of the input's
  gradient) and its logits' all-gather are extra; under SP the backward regathers each
  column-parallel input, the embedding scatters to sequence shards and each replicated
  parameter's gradient is summed over TP (`_tp_extras`). PP: the planner counts 2 sends per
  micro-batch and chunk on every rank; the pipeline's two ends send one way only, (pp v - 1) /
  (pp v) of that on average, and without SP each TP rank sends the whole activation (x tp).
  CP: the planner's ring (cp_ring_bytes) passes K, V cp-1 hops forward and K, V and their
  gradients cp-1 hops each backward; the mesh's ring carries the dK, dV partial sums home, cp
  hops: + one hop per layer and micro-batch (theory/context_parallel.comm_bytes_per_rank).
  DP (over dp x cp, `dp_cp`, when cp > 1): ZeRO-1 is ShardedOptimizer's all-reduce + owners'
  broadcasts (3 Psi on the wire where the planner's reduce-scatter + all-gather move 2 Psi);
  experts average over their replicas, ep_dp = dp x cp / ep ranks, not dp x cp (ZeRO-1 shards
  their optimizer state over ep_dp too; ZeRO-3: FullyShard gathers and reduce-scatters them
  over ep_dp, torchtitan's dp_shard_mod_ep). Expert TP sums the router's and the local experts'
  down biases' gradients over TP (partial on each TP rank): + (h E + E/ep h) per layer and
  micro-batch on tp. EP: the planner's 4 all-to-alls per MoE layer and
  micro-batch (ep_all_to_all_bytes: tokens x top_k x h each, (ep-1)/ep on the wire;
  nothing dropped, as the tiny MoE routes without capacity); before each forward's dispatch the
  mesh all-gathers every rank's top_k x experts + 1 routing counts (int64): + that all-gather.
Activations under full recompute: the pipeline checkpoints whole stage chunks
  (`_stage_recompute`); the planner checkpoints every layer and rebuilds one at a time. A
  plan recomputing k of its L layers per stage (layers_per_stage, recompute_layers) keeps the
  share k / L: L' = the fewest blocks per stage (>= 2) with k L' / L whole, layers = pp L'
  (pp <= 2 keeps every stage at L' blocks), and the mesh checkpoints each rank's first k'
  blocks (parallel/recompute.CheckpointedLayer): both keep (L - k) a_none + k a_full; the
  planner's one rebuilt layer is, again, in torch's checkpoint frame: - that transient.
  Under selective recompute (parallel/recompute.py) both keep every layer's activations but
  the attention core's; the planner also holds one rebuilt core (working_set - kept_layer)
  while its backward runs, which torch's checkpoint keeps in its own frame, outside the
  saved-tensor hooks the memory tracker counts by: - that transient. Under CP the ring core
  keeps q, k, v, its output and log-sum-exp, no scores (FlashAttention's way, with or without
  selective recompute, which leaves the ring alone: no K/V hop repeats, share 0 below): the
  planner's own activation terms with flash_attention=True.
"""
from __future__ import annotations

from fractions import Fraction

from . import plan_terms as terms, planner, recompute as rc
from .catalog import ModelShape
from .pipeline import balanced_split
from .plan_cluster import make_cluster
from .time import wire_bytes_per_rank


def recompute_share(p):
    """Fraction(k, L) when plan `p` fully recomputes k of its stage's L layers (0 < k < L,
    Megatron-LM's block method), else None (none, selective, or whole stages)."""
    of, k = p.get("layers_per_stage") or 0, p["recompute_layers"] or 0
    return Fraction(k, of) if p["recompute"] == "full" and 0 < k < of else None


def miniature_shape(p):
    """(ModelShape, run settings) of the tiny GPT for plan `p` (the rule in the docstring)."""
    tp, pp, v, ep = p["tp"], p["pp"], p["v"], p["ep"]
    heads = 2 * tp
    hidden = 8 * heads
    fits = [n for n in range(2, 8 * pp * v) if (n + 2) % (pp * v) == 0]
    layers = next((n for n in fits if n % pp == 0), fits[0])
    share, recompute_layers = recompute_share(p), None
    if share is not None:   # k of L kept: L' blocks per stage, the fewest >= 2 it divides
        per_stage = share.denominator * -(-2 // share.denominator)
        layers, recompute_layers = pp * per_stage, int(share * per_stage)
    seq, experts = 8 * tp * p["cp"], 2 * ep if ep > 1 else 1
    # top-2 of 2 ep experts: every expert meets tokens in one step (one that gets none has no
    # gradient and, Adam being lazy, no state: its bytes would be missing, not wrong)
    m = ModelShape(name="miniature", display_name="miniature GPT", arch="gpt", layers=layers,
                   hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=32 * tp,
                   experts=experts, top_k=2, tied_embeddings=False, max_seq=seq)
    micro = max(2, pp)
    mbs = min(2, p["micro_batch_size"])
    return m, dict(seq=seq, microbatches=micro, mbs=mbs, batch=p["dp"] * micro * mbs,
                   world=p["dp"] * tp * pp * p["cp"], recompute_layers=recompute_layers)


def _rank_units(m, p):
    """Per pipeline rank: (blocks held, holds the embedding, holds the head), as the mesh
    splits embedding + blocks + head evenly over pp x v stages (split_into_stages, "layers")."""
    stages = p["pp"] * p["v"]
    sizes = balanced_split([1] * (m.layers + 2), stages)
    starts = [sum(sizes[:s]) for s in range(stages)]
    out = []
    for r in range(p["pp"]):
        units = [u for s in range(r, stages, p["pp"]) for u in range(starts[s],
                                                                      starts[s] + sizes[s])]
        first, last = 0 in units, m.layers + 1 in units
        out.append((len(units) - first - last, first, last))
    return out


def _row_biases(m, p):
    """Row-parallel biases (h each) a block holds whole on every TP rank: the attention
    output's and the MLP down projection's, or with experts each local expert's (expert TP,
    parallel/expert_tp.py: the experts' down biases are replicated over TP)."""
    return 1 + (m.experts // p["ep"] if m.experts > 1 else 1)


def _rank_params(m, p, blocks, first, last):
    """A rank's parameters after TP in the planner's units plus the derived differences."""
    tp, h = p["tp"], m.hidden
    _, layer = terms.stage_parameters(m, tp, p["ep"], 1, 1)
    params = blocks * (layer + _row_biases(m, p) * h * (1 - 1 / tp))
    if first:
        emb = terms.tf.embedding_params(m) / tp
        params += emb + (0 if p["sequence_parallel"] else m.max_seq * h * (1 - 1 / tp))
    if last:
        # the final LayerNorm (weight and bias, 2h) is whole on every TP rank; the planner's
        # head_params counts one h of norm, divided by tp with the head
        params += terms.tf.head_params(m) / tp + 2 * h - h / tp
    return params


def planner_side(p):
    """The planner's numbers for plan `p` on its miniature shape: memory by category (its
    worst stage, planner.memory_terms), the same adjusted for the mesh's layout, and bytes per
    rank and step by dimension (the plan_terms byte functions, ring model), adjusted."""
    m, run = miniature_shape(p)
    c = make_cluster("H100", run["world"], precision="fp32", flash_attention=False, dropout=False)
    # full recompute: of every layer (the pipeline's whole stages) or of k of L per stage
    layers = planner.layers_per_stage(m, p["pp"])
    every = (run["recompute_layers"] or layers) if p["recompute"] == "full" else 0
    plan = dict(p, micro_batch_size=run["mbs"], recompute_layers=every)
    mem, _, stage_params, _ = planner.memory_terms(m, c, run["batch"], run["seq"], plan)
    units = _rank_units(m, p)
    held = [_rank_params(m, p, *u) for u in units]
    # a dense model's MLPs are no experts: averaged over dp x cp with the rest
    tp = p["tp"]
    # (expert TP splits each expert's matrices; its down bias is whole on every TP rank)
    experts = [u[0] * (terms.tf.layer_counts(m).mlp_total / (tp * p["ep"]) + m.experts //
                       p["ep"] * m.hidden * (1 - 1 / tp)) if p["ep"] > 1 else 0 for u in units]
    worst = max(held)
    shard, e = p["dp"] * p["cp"], experts[held.index(worst)]
    # ZeRO-1/3 shard the dense states over dp x cp, the experts' over their dp x cp / ep
    # replicas (as the planner's memory_terms does: no difference left to derive here)
    dense, expert = (terms.model_states(n, "fp32", p["zero_stage"], s)
                     for n, s in ((worst - e, shard), (e, shard // p["ep"])))
    adjusted = {k: dense[k] + expert[k] for k in dense}
    tokens, micro = run["mbs"] * run["seq"] // p["cp"], run["microbatches"]
    vb = terms.message_bytes(c.precision)
    act = terms.tp_collective_bytes(m, tokens, vb)
    share = every / layers                 # the layers whose forward collectives run twice
    per_layer = terms.tp_collectives_per_layer(p["recompute"], share)
    tp_planner = micro * layers * per_layer * wire_bytes_per_rank("all_reduce", act, tp)
    mean_blocks = m.layers / p["pp"]
    tp_adjusted = tp_planner * mean_blocks / layers + _tp_extras(m, p, run, mean_blocks)
    send = terms.pp_send_bytes(m, tokens, tp, vb)
    pp_planner = 2 * micro * p["v"] * send if p["pp"] > 1 else 0.0
    pp_adjusted = pp_planner * (p["pp"] * p["v"] - 1) / (p["pp"] * p["v"]) * \
        (1 if p["sequence_parallel"] else tp)
    dp_planner = _dp_bytes(stage_params, p, micro, vb)
    dp_adjusted = sum(_dp_bytes(h, p, micro, vb, e) for h, e in zip(held, experts)) / len(held)
    dp_dim = "dp_shard" if p["zero_stage"] == 3 else "dp_cp" if p["cp"] > 1 else "dp"
    comm = {"tp": (tp_planner, tp_adjusted), "pp": (pp_planner, pp_adjusted),
            dp_dim: (dp_planner, dp_adjusted)}
    if p["cp"] > 1:
        ring = terms.cp_ring_bytes(m, tokens, tp, p["cp"], vb, share)
        # the mesh's ring carries dK, dV home: cp hops of the partial sums, the planner's cp-1
        comm["cp"] = (micro * layers * ring["total"],
                      micro * mean_blocks * (ring["total"] + ring["hop"]))
    if p["ep"] > 1:
        a2a = per_layer * wire_bytes_per_rank(
            "all_to_all", terms.ep_all_to_all_bytes(m, tokens, vb), p["ep"])
        # every forward first all-gathers each rank's (top_k x experts + 1) int64 counts
        counts = (1 + share) * wire_bytes_per_rank("all_gather", 8 * (m.top_k * m.experts + 1),
                                                   p["ep"])
        comm["ep"] = (micro * layers * a2a, micro * mean_blocks * (a2a + counts))
    return dict(model=m, run=run, memory=mem, comm=comm, adjusted=dict(
        adjusted, activations=_mesh_activations(m, run, plan, mem["activations"])))


def _mesh_activations(m, run, p, planner_bytes):
    """The planner's activations for the mesh's way of keeping them: under CP the ring core
    keeps no scores (the planner's FlashAttention count), full recompute checkpoints whole
    stages, and what checkpoint rebuilds (selective: one core, k of L: one layer) is not seen
    by the tracker."""
    c = make_cluster("H100", run["world"], precision="fp32", flash_attention=p["cp"] > 1,
                     dropout=False)
    if p["recompute"] == "full" and run["recompute_layers"] is None:
        return _stage_recompute(m, c, run, p)
    if p["cp"] == 1 and p["recompute"] == "none":
        return planner_bytes
    mem = planner.memory_terms(m, c, run["batch"], run["seq"], p)[0]
    a = planner.activation_terms(m, c, run["seq"], p)
    # the one rebuilt core (selective) or layer (k of L) is in torch's checkpoint frame
    rebuilt = {"selective": a["working_set"] - a["kept_layer"],
               "full": a["working_set"] - a["recomputed_layer"]}.get(p["recompute"], 0.0)
    return mem["activations"] - rebuilt


def _stage_recompute(m, c, run, p):
    """Activations when the mesh recomputes: the pipeline checkpoints whole stage chunks (L / v
    layers), keeping one chunk input (a_full) per chunk in flight and rebuilding a whole chunk
    (L / v x a_none) in backward, where the planner keeps every layer's input and rebuilds one
    layer; the planner's own a_none, a_full, logits and chunks in flight."""
    a = planner.activation_terms(m, c, run["seq"], p)
    layers = planner.layers_per_stage(m, p["pp"])
    chunk = layers / p["v"]
    held = rc.layers_in_flight(layers, run["microbatches"], p["pp"], p["v"]) / chunk
    first = held * a["recomputed_layer"] + chunk * a["kept_layer"]
    last = a["recomputed_layer"] + chunk * a["kept_layer"] + a["logits"]
    return max(first, last) if p["pp"] > 1 else first + a["logits"]


def _tp_extras(m, p, run, blocks):
    """TP wire bytes per rank and step the mesh moves beyond the planner's 4 collectives (or
    all-gather + reduce-scatter pairs) per layer, averaged over the pipeline ranks: the
    vocabulary-parallel ends and the gathered logits; under SP also the backward's regather of
    each column-parallel input (2 all-gathers per layer), the embedding's scatters to sequence
    shards, and the sum over TP of each replicated parameter's gradient (6h per layer, 2h of
    the final norm; an MoE layer under expert TP keeps its gathered input, no regather).
    With experts and tp > 1, with or without SP, the router's and the local experts' down
    biases' gradients summed over TP (h E + E/ep h per layer). Under full recompute each
    forward collective runs twice."""
    tp, vb, h = p["tp"], 4, m.hidden
    # forward passes per micro-batch of the ends: twice when the pipeline rebuilds whole
    # stages, once when only k blocks are checkpointed
    f = 2 if p["recompute"] == "full" and run["recompute_layers"] is None else 1
    # expert TP: the router's (h E) and the local experts' down biases' gradients are partial
    # on each TP rank and summed over TP (parallel/expert_tp.py), with or without SP
    moe = m.experts > 1 and tp > 1
    expert_grads = h * m.experts + m.experts // p["ep"] * h if moe else 0
    # under SP every replicated parameter's gradient is summed: the norms (4h), the attention
    # output's bias (h), the MLP's down bias (h) or the MoE layer's
    replicated = 5 * h + (expert_grads or h)
    seq = run["seq"] // p["cp"]          # this rank's tokens of each sequence
    act = vb * run["mbs"] * seq * h
    logits = wire_bytes_per_rank("all_gather", act / h * m.vocab / tp, tp)
    if not p["sequence_parallel"]:
        # embedding: an all-reduce forward; head: one of its input's gradient backward
        ends = (f + 1) * wire_bytes_per_rank("all_reduce", act, tp) + f * logits
        grads = wire_bytes_per_rank("all_reduce", vb, tp) * expert_grads * blocks
        return run["microbatches"] * (ends / p["pp"] + grads)
    gather, scatter = (wire_bytes_per_rank("all_gather", act / tp, tp),
                       wire_bytes_per_rank("reduce_scatter", act, tp))
    table = vb * seq * h
    # embedding: token and position partial sums reduce-scattered to sequence shards forward,
    # each gradient all-gathered backward
    first = f * (wire_bytes_per_rank("reduce_scatter", table, tp) + scatter) + \
        wire_bytes_per_rank("all_gather", table / tp, tp) + gather
    last = (f + 1) * gather + f * logits + scatter
    # an MoE layer keeps its gathered input (expert_tp.enter): no regather of its own
    regathers = 1 if moe else 2
    grads = wire_bytes_per_rank("all_reduce", vb, tp) * (replicated * blocks + 2 * h / p["pp"])
    return run["microbatches"] * ((first + last) / p["pp"] + regathers * gather * blocks +
                                  grads)


def _dp_bytes(stage_params, p, micro, weight_bytes, expert_params=None):
    """Wire bytes per rank and step of the DP traffic (plan_terms' payloads, ring model).
    With `expert_params` (the mesh's side): experts average over ep_dp = dp x cp / ep ranks,
    not dp x cp (the planner's shard), and ZeRO-1 is ShardedOptimizer's: an all-reduce of the
    gradients (twice a reduce-scatter's wire bytes) and each owner's broadcast of its weights
    (an all-gather's), torch's ZeroRedundancyOptimizer's 3 Psi for the planner's 2 Psi."""
    shard = p["dp"] * p["cp"]
    if p["zero_stage"] == 3 and expert_params is None:
        pay = terms.fsdp_traffic_bytes(stage_params, shard, weight_bytes)
        return micro * (2 * wire_bytes_per_rank("all_gather", pay["all_gather"], shard)
                        + wire_bytes_per_rank("reduce_scatter", pay["reduce_scatter"], shard))
    if expert_params is None:   # (ZeRO-3 with experts: each part's FullyShard over its group)
        pay = terms.dp_traffic_bytes(stage_params, p["zero_stage"], shard, weight_bytes)
        # ZeRO-2 reduce-scatters each micro-batch's gradients, the rest run once per step
        count = dict(reduce_scatter=terms.grad_reductions_per_step(p["zero_stage"], micro))
        return sum(count.get(op, 1) * wire_bytes_per_rank(op, b, shard)
                   for op, b in pay.items())
    if p["zero_stage"] == 2:   # one flat bucket padded to a multiple of the group (zero.py)
        return _dp_bytes(-(-stage_params // shard) * shard, p, micro, weight_bytes)
    ep_dp = dict(p, dp=p["dp"] // p["ep"])    # x cp: the cp ranks hold the same experts
    out = 0.0
    for params, q in ((stage_params - expert_params, p), (expert_params, ep_dp)):
        n = q["dp"] * q["cp"]
        out += _dp_bytes(params, q, micro, weight_bytes)
        if p["zero_stage"] == 1:   # the all-reduce: one more reduce-scatter's bytes
            grads = terms.dp_traffic_bytes(params, 1, n, weight_bytes)["reduce_scatter"]
            out += wire_bytes_per_rank("reduce_scatter", grads, n)
    return out
