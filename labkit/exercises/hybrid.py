"""Lesson 06's exercise: pick a DP x TP x PP layout that fits a model on a cluster and reaches a
target MFU.

`check_layout(answer, ...)` evaluates the learner's plan with the planner (the fields they give
held fixed, the rest searched), and answers with a `Check` in plain words: which rule a layout
breaks, how far over the GPU's memory it is and what to add, or how far from the target MFU it
lands and which part of the step is largest. It never raises.
"""
from ..theory import planner
from . import Check, say

EXERCISE = dict(model="llama-3-70b", gpus=64, gpu="H100", global_batch=256, seq=4096,
                target_mfu=0.45)
ADVICE = {"tp_comm": "TP communication: keep TP inside a node (tp <= 8) or lower it",
          "pp_bubble": "the pipeline bubble: more micro-batches (smaller micro-batch size) or "
                       "interleaving (v > 1)",
          "dp_comm": "exposed DP/ZeRO communication: fewer replicas across nodes, or ZeRO-1 "
                     "instead of ZeRO-3",
          "recompute": "recomputation: recompute less if memory allows",
          "pp_comm": "pipeline sends: fewer stages",
          "cp_comm": "the context-parallel ring: fewer CP ranks or keep them inside a node",
          "optimizer": "the optimizer step", "compute": "compute itself"}


def check_layout(answer, model=EXERCISE["model"], gpus=EXERCISE["gpus"], gpu=EXERCISE["gpu"],
                 global_batch=EXERCISE["global_batch"], seq=EXERCISE["seq"],
                 target_mfu=EXERCISE["target_mfu"], verbose=True):
    """`answer`: a dict of plan fields (dp, tp, pp, and optionally v, micro_batch_size,
    zero_stage, recompute, sequence_parallel)."""
    if not isinstance(answer, dict) or not {"dp", "tp", "pp"} <= set(answer):
        return say(Check(False, "not answered", (
            "Give a dict with at least dp, tp and pp, e.g. dict(dp=8, tp=8, pp=1). Their "
            f"product must be the {gpus} GPUs.")), verbose)
    try:
        fix = planner.parse_fix(",".join(f"{k}={v}" for k, v in answer.items()))
        out = planner.plan(model, gpus, gpu, global_batch=global_batch, seq=seq, fix=fix, top=1)
    except (ValueError, KeyError) as error:
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
