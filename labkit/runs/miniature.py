"""A plan run in miniature: the planner's memory and bytes for a layout, measured on the mesh.

The planner (theory/planner.py) prints, for a plan (dp, tp, pp, cp, ep, v, micro-batch, ZeRO
stage, recompute, sequence parallelism), memory per GPU by category and its communication, all
arithmetic. Here the same layout runs on CPU ranks through the lab's mesh
(`runs.hybrid.report`, which drives `parallel.hybrid.HybridParallel`) on a tiny GPT of the
planner's GPT family, and each measured quantity is set beside what **the planner's own
functions** (planner.memory_terms, plan_terms.stage_parameters / model_states /
tp_collective_bytes / pp_send_bytes / dp_traffic_bytes / fsdp_traffic_bytes, time's ring model)
say for that tiny shape and layout.

Scaling rule (`miniature_shape`): the degrees are kept, the sizes shrink while keeping every
divisibility the layout needs: heads = 2 tp (whole heads per TP rank), hidden = 8 heads, ffn =
4 hidden and vocab = 32 tp (split by TP), seq = 8 tp (split by SP), layers the fewest (>= 2)
with (layers + 2) % (pp v) == 0 (the mesh's embeddings and head are stages of their own:
every virtual stage then has whole units) and, where one exists, layers % pp == 0,
micro-batches max(2, pp) (the interleaved schedule needs a multiple of pp), global batch
dp x micro-batches x micro-batch size (<= 2), experts 2 ep (top-2). The tiny model trains in
fp32, so the planner is asked with precision="fp32", no FlashAttention and no dropout, as the
tiny GPT runs.

Where the planner and the mesh legitimately differ, the difference is derived, named and added
to the planner's number (`adjusted`), never fitted:
- row-parallel biases (attention output, MLP down) are replicated on every TP rank, the
  planner divides all of a layer's weights by tp: + 2 h (1 - 1/tp) per layer held;
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
  DP: ZeRO-1 is ShardedOptimizer's all-reduce + owners' broadcasts (3 Psi on the wire where
  the planner's reduce-scatter + all-gather move 2 Psi); experts average over ep_dp = dp / ep
  ranks, not dp; the experts' all-to-all has no planner term (shown, not judged).
Comparisons of bytes are per rank and step, averaged over the ranks (comm_by_dim sums them);
memory is the worst rank against the planner's worst stage. Activations are compared as a
ratio with no claim of equality: the planner's per-layer formula (Korthikanti et al. 2022,
arXiv 2205.05198) counts a fused 16-bit kernel's tensors, the tiny fp32 model's autograd saves
what eager PyTorch saves. Options the mesh cannot run are refused in one line (`why_not`).
"""
from __future__ import annotations

import math

from ..theory import plan_terms as terms, planner
from ..theory.catalog import ModelShape
from ..theory.pipeline import balanced_split
from ..theory.plan_cluster import make_cluster
from ..theory.time import wire_bytes_per_rank

MAX_RANKS = 8            # the launcher's ranks on a laptop (preflight refuses more)
EQUAL = 1e-9             # relative: exact integer arithmetic on both sides
ACTIVATION_BAND = (0.25, 4.0)   # ratio shown, reported "order of magnitude" only inside it
DEFAULTS = dict(dp=1, tp=1, pp=1, cp=1, ep=1, v=1, micro_batch_size=1, zero_stage=0,
                recompute="none", recompute_layers=0, sequence_parallel=False)


def why_not(p):
    """'' if the mesh can run plan `p` in miniature, else one line naming the option and why."""
    world = p["dp"] * p["tp"] * p["pp"] * p["cp"]
    if world > MAX_RANKS:
        return (f"dp*tp*pp*cp = {world} ranks: the launcher runs at most {MAX_RANKS} CPU ranks "
                "here (plan for --gpus 8 or fewer, or --fix a layout that small)")
    if p["cp"] > 1:
        return ("cp > 1: the miniature does not yet set the planner's CP ring terms beside "
                "the mesh's (run it: python -m labkit run hybrid --cp N)")
    if p["recompute"] != "none":
        return (f"recompute={p['recompute']}: HybridParallel passes no recompute to its "
                "pipeline schedule, so the mesh cannot run it")
    if p["zero_stage"] == 2:
        return "zero_stage=2: the mesh runs ZeRO 0, 1 and 3 (2 would shard accumulated grads)"
    if p["zero_stage"] == 3 and p["ep"] > 1:
        return "zero_stage=3 with ep > 1: the mesh does not shard experts with FullyShard"
    if p["v"] > 1 and p["pp"] == 1:
        return "v > 1 needs pp > 1"
    return ""


def miniature_shape(p):
    """(ModelShape, run settings) of the tiny GPT for plan `p` (the rule in the docstring)."""
    tp, pp, v, ep = p["tp"], p["pp"], p["v"], p["ep"]
    heads = 2 * tp
    hidden = 8 * heads
    fits = [n for n in range(2, 8 * pp * v) if (n + 2) % (pp * v) == 0]
    layers = next((n for n in fits if n % pp == 0), fits[0])
    seq, experts = 8 * tp, 2 * ep if ep > 1 else 1
    # top-2 of 2 ep experts: every expert meets tokens in one step (one that gets none has no
    # gradient and, Adam being lazy, no state: its bytes would be missing, not wrong)
    m = ModelShape(name="miniature", display_name="miniature GPT", arch="gpt", layers=layers,
                   hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=32 * tp,
                   experts=experts, top_k=2, tied_embeddings=False, max_seq=seq)
    micro = max(2, pp)
    mbs = min(2, p["micro_batch_size"])
    return m, dict(seq=seq, microbatches=micro, mbs=mbs, batch=p["dp"] * micro * mbs)


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


def _rank_params(m, p, blocks, first, last):
    """A rank's parameters after TP in the planner's units plus the derived differences."""
    tp, h = p["tp"], m.hidden
    _, layer = terms.stage_parameters(m, tp, p["ep"], 1, 1)
    params = blocks * (layer + 2 * h * (1 - 1 / tp))
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
    world = p["dp"] * p["tp"] * p["pp"]
    c = make_cluster("H100", world, precision="fp32", flash_attention=False, dropout=False)
    plan = dict(p, micro_batch_size=run["mbs"])
    mem, _, stage_params, _ = planner.memory_terms(m, c, run["batch"], run["seq"], plan)
    units = _rank_units(m, p)
    held = [_rank_params(m, p, *u) for u in units]
    worst = max(held)
    shard = p["dp"] * p["cp"]
    adjusted = terms.model_states(worst, "fp32", p["zero_stage"], shard)
    tokens, micro, tp, vb = run["mbs"] * run["seq"], run["microbatches"], p["tp"], 4
    layers = planner.layers_per_stage(m, p["pp"])
    act = terms.tp_collective_bytes(m, tokens, vb)
    per_layer = terms.tp_collectives_per_layer(p["recompute"], 0.0)
    tp_planner = micro * layers * per_layer * wire_bytes_per_rank("all_reduce", act, tp)
    mean_blocks = m.layers / p["pp"]
    tp_adjusted = tp_planner * mean_blocks / layers + _tp_extras(m, p, run, mean_blocks)
    send = terms.pp_send_bytes(m, tokens, tp, vb)
    pp_planner = 2 * micro * p["v"] * send if p["pp"] > 1 else 0.0
    pp_adjusted = pp_planner * (p["pp"] * p["v"] - 1) / (p["pp"] * p["v"]) * \
        (1 if p["sequence_parallel"] else tp)
    dp_planner = _dp_bytes(stage_params, p, micro, vb)
    experts = [u[0] * terms.tf.layer_counts(m).mlp_total / (tp * p["ep"]) for u in units]
    dp_adjusted = sum(_dp_bytes(h, p, micro, vb, e) for h, e in zip(held, experts)) / len(held)
    dp_dim = "dp_shard" if p["zero_stage"] == 3 else "dp"
    comm = {"tp": (tp_planner, tp_adjusted), "pp": (pp_planner, pp_adjusted),
            dp_dim: (dp_planner, dp_adjusted)}
    if p["ep"] > 1:
        comm["ep"] = (0.0, 0.0)      # the planner has no all-to-all term (planner.step_terms)
    return dict(model=m, run=run, memory=mem, adjusted=adjusted, comm=comm)


def _tp_extras(m, p, run, blocks):
    """TP wire bytes per rank and step the mesh moves beyond the planner's 4 collectives (or
    all-gather + reduce-scatter pairs) per layer, averaged over the pipeline ranks: the
    vocabulary-parallel ends and the gathered logits; under SP also the backward's regather of
    each column-parallel input (2 all-gathers per layer), the embedding's scatters to sequence
    shards, and the sum over TP of each replicated parameter's gradient (6h per layer, 2h of the final norm)."""
    tp, vb, h = p["tp"], 4, m.hidden
    act = vb * run["mbs"] * run["seq"] * h
    logits = wire_bytes_per_rank("all_gather", act / h * m.vocab / tp, tp)
    if not p["sequence_parallel"]:
        # embedding: an all-reduce forward; head: one of its input's gradient backward
        ends = 2 * wire_bytes_per_rank("all_reduce", act, tp) + logits
        return run["microbatches"] * ends / p["pp"]
    gather, scatter = (wire_bytes_per_rank("all_gather", act / tp, tp),
                       wire_bytes_per_rank("reduce_scatter", act, tp))
    table = vb * run["seq"] * h
    # embedding: token and position partial sums reduce-scattered to sequence shards forward,
    # each gradient all-gathered backward
    first = wire_bytes_per_rank("reduce_scatter", table, tp) + wire_bytes_per_rank(
        "all_gather", table / tp, tp) + scatter + gather
    last = 2 * gather + logits + scatter
    grads = wire_bytes_per_rank("all_reduce", vb, tp) * (6 * h * blocks + 2 * h / p["pp"])
    return run["microbatches"] * ((first + last) / p["pp"] + 2 * gather * blocks + grads)


def _dp_bytes(stage_params, p, micro, weight_bytes, expert_params=None):
    """Wire bytes per rank and step of the DP traffic (plan_terms' payloads, ring model).
    With `expert_params` (the mesh's side): experts average over ep_dp = dp / ep ranks, not
    dp (the planner's shard), and ZeRO-1 is ShardedOptimizer's: an all-reduce of the
    gradients (twice a reduce-scatter's wire bytes) and each owner's broadcast of its weights
    (an all-gather's), torch's ZeroRedundancyOptimizer's 3 Psi for the planner's 2 Psi."""
    shard = p["dp"] * p["cp"]
    if p["zero_stage"] == 3:
        pay = terms.fsdp_traffic_bytes(stage_params, shard, weight_bytes)
        return micro * (2 * wire_bytes_per_rank("all_gather", pay["all_gather"], shard)
                        + wire_bytes_per_rank("reduce_scatter", pay["reduce_scatter"], shard))
    if expert_params is None:
        pay = terms.dp_traffic_bytes(stage_params, p["zero_stage"], shard, weight_bytes)
        return sum(wire_bytes_per_rank(op, b, shard) for op, b in pay.items())
    dense = _dp_bytes(stage_params - expert_params, p, micro, weight_bytes)
    ep_dp = dict(p, dp=p["dp"] // p["ep"], cp=1)
    out = dense + (_dp_bytes(expert_params, ep_dp, micro, weight_bytes) if expert_params
                   else 0.0)
    if p["zero_stage"] == 1:
        grads = terms.dp_traffic_bytes(stage_params, 1, shard, weight_bytes)["reduce_scatter"]
        out += wire_bytes_per_rank("reduce_scatter", grads, shard)
    return out


def _verdict(planner_bytes, measured, band=None):
    if band:
        ratio = measured / planner_bytes if planner_bytes else math.inf
        return "order of magnitude" if band[0] <= ratio <= band[1] else "off"
    if planner_bytes == measured == 0:
        return "equal"
    return "equal" if abs(measured - planner_bytes) <= EQUAL * max(planner_bytes, 1) else \
        "DIFFERS"


def miniature(plan_fields, steps=1, timeout_s=180):
    """Run plan `plan_fields` (planner field names; missing ones default to 1 / none) in
    miniature; returns {rows, shape, run, report}: rows of (what, planner, adjusted, measured,
    ratio, verdict) for params, grads, optimizer, activations and each mesh dimension's
    bytes per rank and step."""
    p = dict(DEFAULTS, **{k: v for k, v in plan_fields.items() if k in DEFAULTS})
    for key in ("dp", "tp", "pp", "cp", "ep", "v", "micro_batch_size"):
        if not isinstance(p[key], int) or p[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {p[key]!r}")
    why = why_not(p)
    if why:
        raise ValueError(f"cannot run in miniature: {why}")
    side = planner_side(p)
    m, run = side["model"], side["run"]
    from . import hybrid, reference      # torch only from here on
    cfg = reference.RunConfig(steps=steps, global_batch=run["batch"], model_kwargs=dict(
        layers=m.layers, hidden=m.hidden, heads=m.heads, ffn=m.ffn, vocab=m.vocab,
        seq=run["seq"]))
    rep = hybrid.report(cfg=cfg, dp=p["dp"], tp=p["tp"], pp=p["pp"], ep=p["ep"],
                        zero=p["zero_stage"], microbatches=run["microbatches"], virtual=p["v"],
                        schedule="interleaved" if p["v"] > 1 else "1f1b",
                        sequence_parallel=p["sequence_parallel"],
                        experts=m.experts if p["ep"] > 1 else 0, top_k=m.top_k,
                        timeout_s=timeout_s)
    return dict(rows=compare(side, rep, steps, p["sequence_parallel"],
                                p["zero_stage"] == 3), shape=m, run=run,
                plan=p, report=rep)


def compare(side, rep, steps, sp=False, zero3=False):
    """The rows: planner (its own number), adjusted (+ the derived differences), measured."""
    rows = []
    # the worst stage: the pipeline rank holding the most; its ranks' mean (ZeRO-1 in the mesh
    # gives each dp rank whole tensors, so shards are uneven around the planner's even share)
    stage_of = {row["rank"]: row["pp"] for row in rep["mesh_table"]}
    top = max(rep["memory"], key=lambda r: rep["memory"][r]["params"])
    peers = [m for r, m in rep["memory"].items() if stage_of[r] == stage_of[top]]
    for cat in ("params", "grads", "optimizer"):
        rows.append(_row(cat, side["memory"][cat], side["adjusted"][cat],
                         sum(m[cat] for m in peers) / len(peers)))
    acts = max(r["activations"] for r in rep["memory"].values())
    rows.append(_row("activations", side["memory"]["activations"],
                     side["memory"]["activations"], acts, ACTIVATION_BAND))
    world = rep["world_size"]
    for dim, (plan_b, adj_b) in side["comm"].items():
        # a pipeline send between two ranks that are no mesh group's (pp > 2) is "other"
        measured = sum(r["wire_bytes"] for r in rep["comm_by_dim"] if r["dim"] == dim or (
            dim == "pp" and r["dim"] == "other" and r["op"] in ("send", "recv")))
        row = _row(f"{dim} bytes", plan_b, adj_b, measured / world / steps)
        if dim == "ep":
            row["verdict"] = "not in the planner"
        elif dim == "tp" and sp and zero3:
            # ZeRO-3 sums the SP gradients on the shards once per step (parallel/hybrid.py):
            # not derived here, the planner's layer traffic is a lower bound
            row["verdict"] = "layers <= measured" if plan_b <= row["measured"] else "DIFFERS"
        rows.append(row)
    return rows


def _row(what, planner_b, adjusted, measured, band=None):
    ratio = measured / adjusted if adjusted else (1.0 if measured == 0 else math.inf)
    return dict(what=what, planner=planner_b, adjusted=adjusted, measured=measured,
                ratio=ratio, verdict=_verdict(adjusted, measured, band))


def format_rows(out):
    """The comparison as text (bytes per rank; planner = its own formula on the tiny shape)."""
    m, p = out["shape"], out["plan"]
    lines = [f"in miniature (labkit's tiny GPT, the planner's GPT family; memory: the worst "
             f"stage, bytes: per rank and step; planner and +derived modelled): {m.layers} "
             f"layers, hidden {m.hidden}, {m.heads} heads, ffn {m.ffn}, vocab {m.vocab}, "
             f"seq {out['run']['seq']}, batch {out['run']['batch']}"
             f" ({out['run']['microbatches']} micro-batches of {out['run']['mbs']}), fp32; "
             f"dp={p['dp']} tp={p['tp']} pp={p['pp']} ep={p['ep']} v={p['v']} "
             f"ZeRO {p['zero_stage']} sp={'yes' if p['sequence_parallel'] else 'no'}",
             f"{'per rank':<16} {'planner B':>11} {'+derived B':>11} {'measured B':>11} "
             f"{'ratio':>6}  verdict"]
    for r in out["rows"]:
        lines.append(f"{r['what']:<16} {r['planner']:>11,.0f} {r['adjusted']:>11,.0f} "
                     f"{r['measured']:>11,.0f} {r['ratio']:>6.3f}  {r['verdict']}")
    return "\n".join(lines)
