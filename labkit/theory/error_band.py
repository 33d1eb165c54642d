"""How far to trust a plan: its expected error band, from the lab's own check rows.

Both planners are models; on runs they never saw they are off. Every plan therefore carries
the spread of error = modelled / reference - 1 (a ratio of rates: TFLOP/s, tokens/s or first
tokens/s = 1 / TTFT, so +10% means the model promised 10% more than was seen) over rows that
nothing was fitted to:
  - training: the `check` rows of labkit/tables/published_runs.csv (published.py; Table 1's
    rows kept apart), each predicted with the row's own layout held;
  - serving: every row of labkit/tables/published_serving.csv (published_serving.py:
    TensorRT-LLM's H100 throughput and TTFT tables), each predicted by serving.serving_time,
    the model `plan --serve` ranks by, with the row's own settings.
Beside each band, as its `measured` part, the steps `labkit calibrate` measured on one H200
(data/profiles/h200.json, a 1B-shaped Llama): its training steps predicted by the same
planner, its decode steps (replayed as a CUDA graph) by serving_time; where the profile is
missing the band says so. The band is the central COVERAGE of the rows (sorted errors,
floor(n (1 - COVERAGE) / 2) dropped at each end: 2 of 27 each side, 1 of 12; none of 4), so
one outlier with a known cause does not set it; the full range and the mean |error| come with
it. A real run of a plan is then expected near modelled / (1 + error). Imports no torch:
`plan` stays quick.
"""
from __future__ import annotations

import json
import math

from . import (catalog, hardware, planner, profile as gpu_profile, published,
               published_serving, serving)

COVERAGE = 0.8
PROFILE = "profiles/h200.json"      # under hardware.DATA_DIR, from a checkout
MEASURED = "measured on an H200 by `labkit calibrate`, 2026-12-04"
# the measured model's (layers, hidden, heads, ffn, vocab): a Llama-3.2-1B-like shape with its
# vocab cut to 32000 (labkit/calibrate.py builds it; the profile names it "llama-1b-shaped")
LLAMA_1B = dict(layers=16, hidden=2048, heads=16, ffn=8192, vocab=32000)


def model_shape(shape, name="llama-1b-shaped"):
    """The theory's ModelShape of the measured model (Llama family: SwiGLU, no biases)."""
    return catalog.ModelShape(name=name, display_name=name, arch="llama",
                              layers=shape["layers"], hidden=shape["hidden"],
                              heads=shape["heads"], kv_heads=shape["heads"], ffn=shape["ffn"],
                              vocab=shape["vocab"], max_seq=8192)


def band(rows, coverage=COVERAGE):
    """The band of `rows` (dicts with at least `name` and `error`): low and high of the central
    `coverage`, min, max, mean |error|, n, how many lie inside, and the rows outside."""
    if not rows:
        raise ValueError("an error band needs at least one check row, got none")
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage!r}")
    for r in rows:
        if not math.isfinite(r["error"]):
            raise ValueError(f"check row {r['name']!r} has no finite error ({r['error']!r})")
    errors = sorted(r["error"] for r in rows)
    cut = math.floor(round(len(errors) * (1 - coverage) / 2, 9))   # 10 x 0.2 / 2 is 0.999..
    low, high = errors[cut], errors[len(errors) - 1 - cut]
    outside = [r["name"] for r in sorted(rows, key=lambda r: -abs(r["error"]))
               if not low <= r["error"] <= high]
    return dict(low=low, high=high, min=errors[0], max=errors[-1],
                mean_abs=sum(abs(e) for e in errors) / len(errors), n=len(errors),
                inside=len(errors) - len(outside), outside=outside, rows=list(rows))


def _source(text):
    """A row's source, short: 'Korthikanti et al. 2022', 'NVIDIA NeMo'."""
    for cut in (" arXiv", " docs/", " (", ":"):
        text = text.split(cut)[0]
    return text.strip()


def published_rows(rows=None):
    """The published check rows (default: every `check` row of published_runs.csv), each as
    {name, source, gpu, modelled, reference, error}: TFLOP/s per GPU, labkit's convention."""
    rows = published.runs("check") if rows is None else rows
    return [dict(name=r["name"], source=_source(r["source"]), gpu=r["gpu"],
                 precision=r.get("precision") or "bf16", modelled=r["predicted"],
                 reference=r["published"], error=r["error"], unit="TFLOP/s per GPU")
            for r in published.check(rows)]


KINDS = {"tokens_per_s_per_gpu": "throughput", "ttft_ms": "TTFT"}
SECONDS = {"ms to first token": 1e-3, "s per step": 1.0}     # the time units a row may be in


def published_serving_rows(rows=None):
    """The published serving rows (default: every row of published_serving.csv), each as
    {name, source, gpu, kind, modelled, reference, error, unit}: kind "throughput" (output
    tokens/s per GPU) or "TTFT" (ms), error as published_serving.predict (a ratio of rates)."""
    return [dict(name=r["name"], source=_source(r["source"]), gpu=r["gpu"],
                 kind=KINDS[r["metric"]], precision=r["weights"], modelled=r["modelled"],
                 reference=r["published"], error=r["error"], unit=r["unit"])
            for r in published_serving.check(rows)]


def rates(row):
    """(reference, modelled) of a check row as rates, a time (unit in SECONDS) as 1 / time in
    1/s, so that modelled / reference - 1 is the row's error whatever its unit."""
    scale = SECONDS.get(row["unit"])
    if scale is None:
        return row["reference"], row["modelled"]
    return 1 / (row["reference"] * scale), 1 / (row["modelled"] * scale)


def load_measured(path=None):
    """The lab's H200 profile (theory/profile.py's format), or None where it is not here."""
    path = path or hardware.DATA_DIR / PROFILE
    try:
        with open(path, encoding="utf-8") as f:
            return gpu_profile.check_profile(json.load(f), where=str(path))
    except FileNotFoundError:
        return None


def _measured_gpu(measured, profiled):
    """The GPU the check rows are modelled on: the catalog's (datasheet), or with the profile's
    own measured peak and bandwidth when the plan used --gpu-profile."""
    if profiled:
        return gpu_profile.profiled_gpu(measured)
    g = gpu_profile.catalog_gpu(measured["gpu"])
    if g is None:
        raise ValueError(f"the check profile's GPU {measured['gpu']!r} is not in the catalog")
    return g


def measured_training_rows(measured, profiled=False):
    """The profile's training steps against the planner's best one-GPU plan (no recompute, as
    measured): error = measured s / modelled s - 1 (tokens/s, modelled over measured)."""
    m, g = model_shape(LLAMA_1B), _measured_gpu(measured, profiled)
    out = []
    for r in measured["train_step_s"]:
        best = planner.plan(m, 1, g, global_batch=r["batch"], seq=r["seq"],
                            fix="dp=1,recompute=none", top=1)["plans"][0]
        out.append(dict(name=f"train {r['model']} batch {r['batch']} x {r['seq']}",
                        source=MEASURED, gpu=g.name, modelled=best["step_s"],
                        reference=r["seconds"], error=r["seconds"] / best["step_s"] - 1,
                        unit="s per step"))
    return out


def measured_decode_rows(measured, profiled=False):
    """The profile's decode steps against serving_time's TPOT on one GPU, bf16 weights:
    error = measured s / modelled s - 1 (tokens/s, modelled over measured)."""
    m, g = model_shape(LLAMA_1B), _measured_gpu(measured, profiled)
    out = []
    for r in measured["decode_step_s"]:
        t = serving.serving_time(m, gpu=g, batch=r["batch"], prompt_len=r["context"],
                                 new_tokens=1)["tpot_s"]
        out.append(dict(name=f"decode {r['model']} batch {r['batch']} context {r['context']}",
                        mode=r.get("mode", "eager"), source=MEASURED, gpu=g.name,
                        modelled=t, reference=r["seconds"], error=r["seconds"] / t - 1,
                        unit="s per step"))
    return out


def training_band(rows=None, measured="default", profiled=False):
    """The training planner's band over the published check rows (`rows`: published_runs.csv
    rows; default its `check` rows), with the H200's measured steps beside it (`measured`: a
    profile dict, None for none, default the lab's file)."""
    out = band(published_rows(rows))
    out.update(kind="training", quantity="modelled / published - 1 in TFLOP/s per GPU",
               basis="published runs (published_runs.csv, use=check)")
    measured = load_measured() if measured == "default" else measured
    out["measured"] = band(measured_training_rows(measured, profiled)) \
        if measured and measured["train_step_s"] else None
    return out


def serving_band(rows=None, measured="default", profiled=False):
    """The serving model's band over the published serving runs (`rows`: published_serving.csv
    rows; default all of them), with the H200's measured decode steps beside it (`measured`: a
    profile dict, None for none, default the lab's file; the band's `measured` is None where
    there are no decode steps)."""
    out = band(published_serving_rows(rows))
    out.update(kind="serving", quantity="modelled / published - 1 in output tokens/s per GPU, "
                                        "TTFT rows in 1 / TTFT",
               basis="published serving runs (published_serving.csv)")
    measured = load_measured() if measured == "default" else measured
    out["measured"] = band(measured_decode_rows(measured, profiled)) \
        if measured and measured["decode_step_s"] else None
    return out


def _pct(x):
    return f"{x:+.0%}"


def format_band(b, modelled=None, unit="tokens/s/GPU"):
    """The band as text lines (what `plan` prints under its table); `modelled`: the best plan's
    number in `unit`, turned into the range a real run is expected in."""
    lines = [f"expected error {_pct(b['low'])}/{_pct(b['high'])} ({b['quantity']}; "
             f"{b['inside']} of the {b['n']} {b['basis']} lie inside the band, none was fitted "
             f"to; all: {_pct(b['min'])}/"
             f"{_pct(b['max'])}, mean |error| {b['mean_abs']:.1%})"]
    if modelled:
        lines.append(f"  so the best plan's {modelled:,.0f} {unit} (modelled) would measure "
                     f"about {modelled / (1 + b['high']):,.0f}-{modelled / (1 + b['low']):,.0f}")
    counts = {}             # by source (and, for serving, throughput or TTFT)
    for r in b["rows"]:
        key = r["source"] + (f" {r['kind']}" if "kind" in r else "")
        counts[key] = counts.get(key, 0) + 1
    lines.append("  rows from: " + ", ".join(f"{s} ({n})" for s, n in counts.items())
                 + "; each named in --json's error_band.rows")
    if b["outside"]:
        errors = {r["name"]: r["error"] for r in b["rows"]}
        lines.append("  outside the band: " + ", ".join(f"{n} {_pct(errors[n])}"
                                                        for n in b["outside"]))
    if b.get("measured"):
        lines.append(f"  {MEASURED}, one GPU (mean |error| {b['measured']['mean_abs']:.1%}): "
                     + ", ".join(f"{r['name']}" + (f" ({r['mode']})" if "mode" in r else "")
                                 + f" {_pct(r['error'])}" for r in b["measured"]["rows"]))
    elif "measured" in b:
        lines.append(f"  measured on one GPU: missing ({PROFILE} is not here or has no such "
                     "steps)")
    return lines
