"""DP x TP x PP on one mesh, predicted: the planner's bytes per GPU for labkit's tiny GPT.

The planner (theory/planner.py) sums, for the worst pipeline stage, the model states of the
stage's layers split by tp (and the optimizer state by dp under ZeRO-1) and the activations of
the micro-batches the schedule keeps in flight (Narayanan et al. 2021, arXiv 2104.04473;
Korthikanti et al. 2022, arXiv 2205.05198). Here it is asked about the tiny GPT as labkit's
hybrid run trains it: fp32 Adam, no dropout, the softmax stored, no CUDA reserve.
"""
from __future__ import annotations

from . import planner


def tiny_gpt_memory(*, layers, hidden, heads, ffn, vocab, seq, global_batch, dp, tp, pp,
                    microbatches=2, virtual=1, sequence_parallel=False, zero=0,
                    optimizer="adam") -> dict | None:
    """Bytes per GPU (worst stage) by category and their sum `peak`; None where the planner has
    no such plan (e.g. more stages than blocks: it gives the embedding and the head no stage
    of their own)."""
    shape = (f"layers={layers},hidden={hidden},heads={heads},ffn={ffn},"
             f"vocab={vocab},seq={seq},arch=gpt,tied=false")
    fix = dict(dp=dp, tp=tp, pp=pp, v=virtual, zero_stage=zero, recompute="none",
               micro_batch_size=global_batch // (dp * microbatches),
               sequence_parallel=sequence_parallel)
    try:
        plan = planner.plan(shape, dp * tp * pp, "H100", global_batch=global_batch, seq=seq,
                            precision="fp32", dropout=False, flash_attention=False, fix=fix,
                            top=1)["plans"][0]
    except ValueError:
        return None
    # a CPU run has no CUDA context or caching allocator: the reserve is left out
    out = {k: v for k, v in plan["memory_bytes"].items() if k not in ("total", "reserved")}
    if optimizer == "sgd":
        out["optimizer"] = 0
    out["peak"] = sum(out.values())
    return out
