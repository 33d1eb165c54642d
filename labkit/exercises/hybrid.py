"""Lesson 06's exercises: average gradients over the data-parallel group of a mesh (on 4
ranks), pick a DP x TP x PP layout that fits a model on a cluster and reaches a target MFU, and
the bytes of model states per GPU of a hybrid layout.

`check_dp_average(fn)` runs the learner's `fn(ctx, mesh, grad)` on a dp=2 x tp=2 mesh: each rank
must end with the mean of `grad` over its DP group only (the replicas of the same TP shard),
not over the world or the TP group. The first wrong answer gets a hint, later ones (or
`show_solution()`) the code.

`check_layout(answer, ...)` evaluates the learner's plan with the planner (the fields they give
held fixed, the rest searched), and answers with a `Check` in plain words: which rule a layout
breaks, how far over the GPU's memory it is and what to add, or how far from the target MFU it
lands and which part of the step is largest. It never raises.
"""
import torch

from ..theory import catalog, planner
from ..theory import memory as tm
from . import (Check, Hints, Mistake, check_number, not_a_function, not_started, say, show,
               with_hint)

EXERCISE = dict(model="llama-3-70b", gpus=96, gpu="H100", global_batch=384, seq=4096,
                target_mfu=0.45)
MESH = dict(dp=2, tp=2)
DP_HINTS = Hints(
    concept="only the ranks that hold copies of the same weights (the replicas) may average "
            "their gradients; every collective takes group=, and the mesh names its groups.",
    code="ctx.comm.all_reduce(grad, group=mesh['dp']) sums over this rank's DP group (its "
         "replicas); then return grad / mesh['dp'].size.")


LAYOUT_HINTS = Hints(
    concept="keep TP inside a node (its all-reduces are on the critical path), split the model "
            "states until they fit (TP, PP or ZeRO), and give the rest of the GPUs to DP, whose "
            "traffic overlaps.",
    code="dict(dp=24, tp=4, pp=1): TP 4 inside a node, 24 replicas, the planner picks ZeRO "
         "and recomputation.", exercise=2, kind="answer")
MEMORY_HINTS = Hints(
    concept="TP and PP each split the parameters a GPU holds; ZeRO-1 then splits only the "
            "optimizer state over the data-parallel replicas.",
    code="params / (tp x pp) x (2 + 2 + 12 / dp) bytes, in GB.", exercise=3, kind="formula")
HINTS = {1: DP_HINTS, 2: LAYOUT_HINTS, 3: MEMORY_HINTS}


def show_solution(exercise=1):
    """Print the code (exercise 1), a layout (2) or the formula (3)."""
    show(HINTS, exercise)


def _mesh_input(rank):
    return torch.full((4,), 10.0 ** rank)      # 1, 10, 100, 1000: every sum tells its ranks


def _run_mesh(ctx, fn):
    mesh = ctx.mesh(**MESH)
    grad = _mesh_input(ctx.rank)
    out = fn(ctx, mesh, grad)
    out = out if isinstance(out, torch.Tensor) else grad
    groups = {name: list(mesh[name].ranks) for name in ("dp", "tp")}
    return dict(rank=ctx.rank, out=out.detach().to(torch.float32, copy=True), groups=groups)


def check_dp_average(fn, timeout_s=30.0, verbose=True):
    """Run `fn(ctx, mesh, grad)` on a dp=2 x tp=2 mesh; each rank: the mean over its DP group."""
    from ..runtime.launch import LaunchError, launch
    if (refused := not_a_function(fn, "fn(ctx, mesh, grad)")) is not None:
        return say(refused, verbose)
    try:
        results = launch(_run_mesh, MESH["dp"] * MESH["tp"], fn, timeout_s=timeout_s)
    except LaunchError as error:
        text = str(error)
        if "NotImplementedError" in text:
            return say(Check(False, "not written", "NOT WRITTEN YET: your function raised "
                             "NotImplementedError. Hint: every collective takes group=; which "
                             "of the mesh's groups holds copies of the same weights?"), verbose)
        if (busy := not_started(text)) is not None:
            return say(Check(False, "slow", busy), verbose)
        last = [line for line in text.splitlines() if line.strip()][-1].strip()
        return say(Check(False, "raised", f"YOUR CODE RAISED (or hung) on a rank: {last}. "
                         f"{DP_HINTS.after_failure()}"), verbose)
    check = with_hint(_judge_dp(results), DP_HINTS)
    return say(check, verbose)


def _judge_dp(results):
    world = len(results)
    for res in results:
        got, r, groups = res["out"].reshape(-1), res["rank"], res["groups"]
        mean = lambda ranks: sum(_mesh_input(q) for q in ranks) / len(ranks)   # noqa: E731
        summed = lambda ranks: sum(_mesh_input(q) for q in ranks)             # noqa: E731
        if torch.allclose(got, mean(groups["dp"])):
            continue
        where = f"rank {r} (DP group {groups['dp']}, TP group {groups['tp']})"
        if torch.allclose(got, summed(groups["dp"])):
            return Check(False, "summed", f"On {where} the DP group's gradients are summed, "
                         f"not averaged: divide by the DP group's size, {len(groups['dp'])}.")
        if torch.allclose(got, mean(range(world))) or torch.allclose(got, summed(range(world))):
            return Check(False, "world", f"On {where} the gradient is reduced over all {world} "
                         "ranks: ranks of another TP group hold other shards of the weights; "
                         "only the DP group holds copies of the same shard.")
        if torch.allclose(got, mean(groups["tp"])) or torch.allclose(got, summed(groups["tp"])):
            return Check(False, "tp group", f"On {where} the gradient is reduced over the TP "
                         "group: its ranks hold different shards; average over the replicas "
                         "instead.")
        if torch.allclose(got, _mesh_input(r)):
            return Check(False, "not reduced", f"On {where} nothing was reduced.")
        return Check(False, "wrong value", f"On {where} the result is not the mean over the DP "
                     "group.")
    return Check(True, "", f"Correct: every rank holds the mean over its DP group (ranks "
                 f"{results[0]['groups']['dp']} for rank 0): the replicas of the same shard "
                 "agree, the other shards are left alone.")


ADVICE = {"tp_comm": "TP communication: keep TP inside a node (tp <= 8) or lower it",
          "pp_bubble": "the pipeline bubble: more micro-batches (smaller micro-batch size) or "
                       "interleaving (v > 1)",
          "dp_comm": "exposed DP/ZeRO communication: fewer replicas across nodes, or ZeRO-1 "
                     "instead of ZeRO-3",
          "recompute": "recomputation: recompute less if memory allows",
          "pp_comm": "pipeline sends: fewer stages",
          "cp_comm": "the context-parallel ring: fewer CP ranks or keep them inside a node",
          "ep_comm": "the experts' all-to-all: a smaller ep, or keep the EP group inside a node",
          "optimizer": "the optimizer step", "compute": "compute itself",
          "overlap_slowdown": "compute slowed by the communication it hides: less TP or DP "
                              "traffic (smaller tp, fewer ZeRO-3 gathers)"}


def check_layout(answer, model=EXERCISE["model"], gpus=EXERCISE["gpus"], gpu=EXERCISE["gpu"],
                 global_batch=EXERCISE["global_batch"], seq=EXERCISE["seq"],
                 target_mfu=EXERCISE["target_mfu"], verbose=True):
    """`answer`: a dict of plan fields (dp, tp, pp, and optionally v, micro_batch_size,
    zero_stage, recompute, sequence_parallel)."""
    check = _layout(answer, model, gpus, gpu, global_batch, seq, target_mfu)
    check = with_hint(check, LAYOUT_HINTS)
    return say(check, verbose)


def _layout(answer, model, gpus, gpu, global_batch, seq, target_mfu):
    verbose = False     # the caller says it
    if not isinstance(answer, dict) or not {"dp", "tp", "pp"} <= set(answer):
        return say(Check(False, "not answered", (
            "Give a dict with at least dp, tp and pp, e.g. dict(dp=8, tp=8, pp=1). Their "
            f"product must be the {gpus} GPUs.")), verbose)
    try:
        fix = planner.parse_fix(",".join(f"{k}={v}" for k, v in answer.items()))
        out = planner.plan(model, gpus, gpu, global_batch=global_batch, seq=seq, fix=fix, top=1)
    except (ValueError, KeyError, TypeError) as error:
        return say(Check(False, "illegal", f"That layout cannot run: {error}"), verbose)
    p = out["plans"][0]
    if not p["fits"]:
        return say(Check(False, "does not fit", (
            f"It does not fit: the best version of it {p['reason']}. Memory per GPU: "
            + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in p["memory_bytes"].items()
                        if k != "total" and v)
            + ". Split the model states further (more tp or pp, or ZeRO) or keep fewer "
              "activations (recompute, sequence parallelism).")), verbose)
    if p["mfu"] < target_mfu:
        largest = max((k for k in p["breakdown_s"] if k != "compute"),
                      key=lambda k: p["breakdown_s"][k])
        return say(Check(False, "too slow", (
            f"It fits ({p['memory_bytes']['total'] / 1e9:.1f} GB per GPU) but reaches a "
            f"modelled MFU of {p['mfu']:.1%}, below the {target_mfu:.0%} target. Beside "
            f"compute, the largest part of its {p['step_s']:.2f} s step is "
            f"{ADVICE[largest]} ({p['breakdown_s'][largest]:.2f} s).")), verbose)
    return say(Check(True, "", (
        f"Yes: it fits ({p['memory_bytes']['total'] / 1e9:.1f} GB per GPU) and reaches a "
        f"modelled MFU of {p['mfu']:.1%} (target {target_mfu:.0%}), with "
        f"v={p['v']}, micro-batch {p['micro_batch_size']}, ZeRO-{p['zero_stage']}, recompute "
        f"{p['recompute']}, sequence parallel {p['sequence_parallel']}.")), verbose)


HYBRID_MEMORY = dict(model="llama-3-70b", dp=2, tp=8, pp=4, zero_stage=1)


def hybrid_state_gb(model=HYBRID_MEMORY["model"], dp=HYBRID_MEMORY["dp"],
                    tp=HYBRID_MEMORY["tp"], pp=HYBRID_MEMORY["pp"],
                    zero_stage=HYBRID_MEMORY["zero_stage"]):
    """GB of model states per GPU: TP x PP split the parameters, ZeRO shards over DP (equal
    stages assumed; mixed-precision Adam)."""
    psi = catalog.model(model).param_count() / (tp * pp)
    return tm.model_state_bytes(psi, zero_stage=zero_stage, world_size=dp)["total"] / 1e9


def check_hybrid_memory(answer, verbose=True):
    """GB of model states per GPU for the HYBRID_MEMORY layout."""
    h = HYBRID_MEMORY
    psi = catalog.model(h["model"]).param_count()
    local = psi / (h["tp"] * h["pp"])
    expected = hybrid_state_gb()
    mistakes = [
        Mistake(16 * local / 1e9, "no ZeRO", f"that is 16 bytes per local parameter: ZeRO-1 "
                f"also divides the 12 bytes of optimizer state by dp = {h['dp']}"),
        Mistake(16 * psi / h["tp"] / 1e9, "forgot pp", f"the pipeline splits the layers too: "
                f"divide the parameters by tp x pp = {h['tp'] * h['pp']}"),
        Mistake(16 * psi / h["pp"] / 1e9, "forgot tp", "TP splits every weight matrix too: "
                f"divide the parameters by tp x pp = {h['tp'] * h['pp']}"),
        Mistake(16 * local / h["dp"] / 1e9, "ZeRO-3", "that divides all of it by dp (ZeRO-3); "
                "ZeRO-1 shards only the optimizer state"),
        Mistake(tm.model_state_bytes(local, zero_stage=2, world_size=h["dp"])["total"] / 1e9,
                "ZeRO-2", "that shards the gradients as well (ZeRO-2); ZeRO-1 shards only the "
                "optimizer state"),
        Mistake((2 + 4 + 12 / h["dp"]) * local / 1e9, "fp32 gradients", "that counts fp32 "
                "gradients (4 bytes, 18 bytes per parameter: the planner's convention, as "
                "Megatron-LM accumulates them); this exercise counts bf16 gradients as the ZeRO "
                "paper does: 2 + 2 + 12 = 16 bytes per parameter"),
    ]
    return check_number(answer, expected, what=f"GB of model states per GPU (Llama 3 70B, "
                        f"dp={h['dp']} tp={h['tp']} pp={h['pp']}, ZeRO-{h['zero_stage']})",
                        unit="GB", mistakes=mistakes, verbose=verbose, hints=MEMORY_HINTS,
                        explain="Activations and the embedding's extra weight on the first and "
                                "last stage come on top.")
