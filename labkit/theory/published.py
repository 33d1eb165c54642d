"""The planner against published runs (data/published_runs.csv): one declared fit, then checks.

The "calibration" rows (Narayanan et al. 2021 Table 1) fix the planner's one fitted number,
kernels.IN_STEP_GEMM_FRACTION (fit_in_step_gemm_fraction); the "check" rows are never fitted
to and make the error band (theory/error_band.py). A row fixes the layout
its source states; the rest is searched (a recompute the source leaves unsaid: the least that
fits). Where a row gives tokens/s/GPU the comparison is in tokens (no FLOPs convention
involved) and the published TFLOP/s is re-expressed in the published convention (6 N + 12 L h s
per token, no causal halving); else it compares TFLOP/s by the row's `metric` (mfu: the
predicted tokens/s in that convention; hfu: the planner's HFU, the FLOPs run with recompute,
which for these unfused rows is the convention).
The planner's own MFU halves the causal scores (transformer.model_flops_per_token).
theory/error_band.py turns the check rows' errors into the band every `plan` prints.
"""
from __future__ import annotations

import csv

from . import hardware, planner, transformer as tf


def _fix(r, m):
    fix = {k: r[k] for k in planner.FIELDS if str(r.get(k, "")).strip() != ""}
    if fix.get("recompute") == "full" and "recompute_layers" not in fix and "pp" in fix:
        fix["recompute_layers"] = planner.layers_per_stage(m, int(fix["pp"]))   # every layer
    return planner.parse_fix(fix)


def predict(r, achievable=None, in_step_gemm_fraction=None):
    """labkit's best plan for row `r` with the row's layout held."""
    m = planner.parse_model(r["model"])
    return planner.plan(m, int(r["gpus"]), r["gpu"], int(r["gpus_per_node"]), r["intra_link"],
                        r["inter_link"], global_batch=int(r["global_batch"]), seq=int(r["seq"]),
                        fix=_fix(r, m), top=1, achievable=achievable,
                        flash_attention=r["attention"] == "flash",
                        precision=r.get("precision") or "bf16",
                        stack=r.get("stack") or None,
                        fp8_recipe=r.get("fp8_recipe") or "delayed",
                        in_step_gemm_fraction=in_step_gemm_fraction)["plans"][0]


def published_tflops(r):
    """The row's published TFLOP/s per GPU in labkit's convention where it gives tokens/s."""
    if str(r.get("tokens_per_s_per_gpu", "")).strip():
        m = planner.parse_model(r["model"])
        return float(r["tokens_per_s_per_gpu"]) * tf.model_flops_per_token(m, int(r["seq"])) / 1e12
    return float(r["tflops_per_gpu"])


def check(rows, achievable=None, in_step_gemm_fraction=None):
    """Each row with `predicted` TFLOP/s per GPU, `published` (same convention), `error`
    (predicted / published - 1) and the `plan`."""
    out = []
    for r in rows:
        best = predict(r, achievable, in_step_gemm_fraction)
        if r["metric"] == "hfu":       # FLOPs run: the planner's HFU counts them (unfused)
            predicted = best["hfu"] * hardware.gpu(r["gpu"]).bf16_flops / 1e12
        else:                           # the published convention, from predicted tokens/s
            m = planner.parse_model(r["model"])
            predicted = best["tokens_per_s_per_gpu"] * tf.model_flops_per_token(
                m, int(r["seq"])) / 1e12
        published = published_tflops(r)
        out.append(dict(r, predicted=predicted, published=published, plan=best,
                        error=predicted / published - 1))
    return out


def fit_in_step_gemm_fraction(rows=None, tolerance=1e-3):
    """The one fitted number (kernels.IN_STEP_GEMM_FRACTION): the factor on every in-step
    GEMM's rate that makes the calibration rows' mean signed error zero, by bisection (the
    error falls as the factor falls). Only `use == calibration` rows are looked at; the check
    rows stay a test of it."""
    rows = [r for r in (rows or runs("calibration")) if r["use"] == "calibration"]
    if not rows:
        raise ValueError("no calibration rows to fit on")

    def mean_error(fraction):
        return sum(r["error"] for r in check(rows, in_step_gemm_fraction=fraction)) / len(rows)
    low, high = 0.3, 1.0
    if mean_error(high) <= 0:
        return high
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if mean_error(middle) < 0 else (low, middle)
    return round((low + high) / 2, 3)


def runs(source=None):
    """Rows of data/published_runs.csv (optionally only those whose `use` is `source`)."""
    with open(hardware.DATA_DIR / "published_runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if source in (None, r["use"])]
