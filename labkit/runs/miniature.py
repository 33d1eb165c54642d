"""A plan run in miniature: the planner's memory and bytes for a layout, measured on the mesh.

The planner (theory/planner.py) prints, for a plan (dp, tp, pp, cp, ep, v, micro-batch, ZeRO
stage, recompute, sequence parallelism), memory per GPU by category and its communication, all
arithmetic. Here the same layout runs on CPU ranks through the lab's mesh
(`runs.hybrid.report`, which drives `parallel.hybrid.HybridParallel`) on a tiny GPT of the
planner's GPT family, and each measured quantity is set beside what **the planner's own
functions** (planner.memory_terms, plan_terms.stage_parameters / model_states /
tp_collective_bytes / cp_ring_bytes / ep_all_to_all_bytes / pp_send_bytes / dp_traffic_bytes /
fsdp_traffic_bytes, time's ring model) say for that tiny shape and layout, on up to MAX_RANKS =
16 CPU ranks (dp2 x tp2 x pp2 x cp2).

The tiny shape, the planner's numbers for it and the differences between the planner's layout
and the mesh's, each derived and named (never fitted), are in theory/miniature_terms.py: the
planner's number, `adjusted` (+ the derived differences) and `measured` stand in a row.
Comparisons of bytes are per rank and step, averaged over the ranks (comm_by_dim sums them);
memory is the worst rank against the planner's worst stage. Activations are compared as a
ratio with no claim of equality: the planner's per-layer formula (Korthikanti et al. 2022,
arXiv 2205.05198) counts a fused 16-bit kernel's tensors, the tiny fp32 model's autograd saves
what eager PyTorch saves. Options the mesh cannot run are refused in one line (`why_not`).
"""
from __future__ import annotations

import math

from ..theory.miniature_terms import (miniature_shape, planner_side,  # noqa: F401 (API)
                                      recompute_share)

MAX_RANKS = 16           # dp2 x tp2 x pp2 x cp2: the largest mesh the lab's tests run
EQUAL = 1e-9             # relative: exact integer arithmetic on both sides
ACTIVATION_BAND = (0.25, 4.0)   # ratio shown, reported "order of magnitude" only inside it
DEFAULTS = dict(dp=1, tp=1, pp=1, cp=1, ep=1, v=1, micro_batch_size=1, zero_stage=0,
                recompute="none", recompute_layers=0, sequence_parallel=False,
                layers_per_stage=0)   # the plan's (0: unknown), for k of L layers recomputed


def why_not(p):
    """'' if the mesh can run plan `p` in miniature, else one line naming the option and why."""
    world = p["dp"] * p["tp"] * p["pp"] * p["cp"]
    if world > MAX_RANKS:
        return (f"dp*tp*pp*cp = {world} ranks: the launcher runs at most {MAX_RANKS} CPU ranks "
                f"here (plan for --gpus {MAX_RANKS} or fewer, or --fix a layout that small)")
    share = recompute_share(p)
    if share is not None:
        k_of = f"recompute of {p['recompute_layers']} of {p['layers_per_stage']} layers"
        if p["v"] > 1 or p["pp"] > 2 or p["zero_stage"] == 3:
            return (f"{k_of} with v > 1, pp > 2 or zero_stage=3: the mesh checkpoints a "
                    "rank's first k blocks, on stages of equal blocks, without FullyShard")
        if share.denominator > 8:
            return f"{k_of}: keeping that share needs over 8 layers per stage in miniature"
    if p["zero_stage"] == 2 and p["pp"] > 1:   # the planner never proposes it
        return "zero_stage=2 with pp > 1: the mesh runs ZeRO-2 without a pipeline only"
    if p["zero_stage"] == 2 and p["ep"] > 1:
        return ("zero_stage=2 with ep > 1: the mesh does not shard experts' gradients "
                "(an expert without tokens on a replica has none)")
    if p["v"] > 1 and p["pp"] == 1:
        return "v > 1 needs pp > 1"
    return ""


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
    bytes per rank and step. recompute="full" recomputes every layer (the pipeline's whole
    stages) or, given `layers_per_stage` and fewer `recompute_layers`, the same share of each
    stage's blocks (checkpointed one by one); "selective" every attention core
    (parallel/recompute.py)."""
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
    rep = hybrid.report(cfg=cfg, dp=p["dp"], tp=p["tp"], pp=p["pp"], cp=p["cp"], ep=p["ep"],
                        zero=p["zero_stage"], microbatches=run["microbatches"], virtual=p["v"],
                        schedule="interleaved" if p["v"] > 1 else "1f1b",
                        sequence_parallel=p["sequence_parallel"],
                        recompute=p["recompute"], recompute_layers=run["recompute_layers"],
                        experts=m.experts if p["ep"] > 1 else 0, top_k=m.top_k,
                        cluster="8xH100-NVLink" if run["world"] <= 8 else "2x8xH100-IB",
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
                     side["adjusted"]["activations"], acts, ACTIVATION_BAND))
    world = rep["world_size"]
    for dim, (plan_b, adj_b) in side["comm"].items():
        # a pipeline send between two ranks that are no mesh group's (pp > 2) is "other";
        # the experts' gradients (on their replicas, ep_dp) are part of the planner's DP term
        measured = sum(r["wire_bytes"] for r in rep["comm_by_dim"] if r["dim"] == dim or (
            dim == "pp" and r["dim"] == "other" and r["op"] in ("send", "recv")) or (
            dim.startswith("dp") and r["dim"] == "ep_dp"))
        row = _row(f"{dim} bytes", plan_b, adj_b, measured / world / steps)
        if dim == "tp" and sp and zero3:
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
             f"dp={p['dp']} tp={p['tp']} pp={p['pp']} cp={p['cp']} ep={p['ep']} v={p['v']} "
             f"ZeRO {p['zero_stage']} sp={'yes' if p['sequence_parallel'] else 'no'} "
             f"recompute={p['recompute']}" + (f" {out['run']['recompute_layers']} of "
                                               f"{m.layers // p['pp']} blocks per stage"
                                               if out["run"]["recompute_layers"] else ""),
             f"{'per rank':<16} {'planner B':>11} {'+derived B':>11} {'measured B':>11} "
             f"{'ratio':>6}  verdict"]
    for r in out["rows"]:
        lines.append(f"{r['what']:<16} {r['planner']:>11,.0f} {r['adjusted']:>11,.0f} "
                     f"{r['measured']:>11,.0f} {r['ratio']:>6.3f}  {r['verdict']}")
    return "\n".join(lines)


def recompute_drop(plan_fields, mode="full", runs=None, **options):
    """The same plan run in miniature without and with `mode` recompute ("full" or
    "selective"): {planner, adjusted, measured} activations with / without, and the runs
    (`runs`: those already made, by mode, e.g. the "none" run of an earlier call). Full: the
    planner's memory_terms keep only each layer's input, `adjusted` is the mesh's whole-stage
    checkpoint (_stage_recompute); selective: both keep every layer's activations but the
    attention core's a s^2 b (the planner's a_selective)."""
    runs = dict(runs or {})
    for rc_mode in ("none", mode):
        if rc_mode not in runs:
            runs[rc_mode] = miniature(dict(plan_fields, recompute=rc_mode), **options)
    acts = {k: next(r for r in runs[k]["rows"] if r["what"] == "activations")
            for k in ("none", mode)}
    return dict({col: acts[mode][col] / acts["none"][col]
                 for col in ("planner", "adjusted", "measured")}, runs=runs, mode=mode)


def format_drop(drop):
    """One line: the activations ratio with / without recompute, three ways."""
    return (f"activations with / without {drop.get('mode', 'full')} recompute: planner "
            f"{drop['planner']:.3f} (modelled), +derived {drop['adjusted']:.3f} (modelled), "
            f"measured {drop['measured']:.3f}")
