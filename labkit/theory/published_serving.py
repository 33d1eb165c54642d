"""The serving model against published serving runs (data/published_serving.csv): checks.

The rows are TensorRT-LLM's H100 performance tables, each with its source. The `check` rows
(Llama 2 7B and 70B) are never fitted to; the `calibration` rows (GPT-J 6B and Falcon 180B
from the same tables) fit the serving model's one fitted number, pricing.ENQUEUE_S: the host's
time per kernel of an engine that enqueues kernel by kernel (no CUDA graphs, as these tables
ran), which is what a 128-token prefill waits for (fit_enqueue_s). Each row is predicted by
serving.serving_time with its own settings (GPU, model shape, weights and KV precision, tp, pp,
batch, input and output lengths, execution).
The rows come from static-batch runs (TensorRT-LLM gptSessionBenchmark: the whole batch is
prefilled, then decoded together), so the published metric maps onto the model as:
  - tokens_per_s_per_gpu: batch x output_len / (TTFT + (output_len - 1) x TPOT) / GPUs, the
    prefill included (serving_time's tokens_per_s_per_gpu); error = modelled / published - 1;
  - ttft_ms: the modelled TTFT; error = published / modelled - 1.
Either way the error is a ratio of rates (tokens/s, or first tokens/s = 1 / TTFT), so a
positive error means the model is optimistic. theory/error_band.py turns the errors into the
band `plan --serve` prints; bench/serving_check.py writes them to data/serving_check.csv.
"""
from __future__ import annotations

import csv

import math

from . import hardware, serving

TABLE = "published_serving.csv"     # under hardware.DATA_DIR (data/ links to labkit/tables/)
METRICS = {"tokens_per_s_per_gpu": "output tokens/s per GPU", "ttft_ms": "ms to first token"}


def predict(row, enqueue_s=None) -> tuple[float, float]:
    """(modelled, error) of one published row, in the row's own metric (METRICS);
    `enqueue_s`: the host's seconds per kernel (default pricing.ENQUEUE_S)."""
    if row["metric"] not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {row['metric']!r}")
    r = serving.serving_time(row["model"], gpu=row["gpu"], tp=int(row["tp"]), pp=int(row["pp"]),
                             batch=int(row["batch"]), prompt_len=int(row["input_len"]),
                             new_tokens=int(row["output_len"]), weights=row["weights"],
                             kv_dtype=row["kv_dtype"], execution=row["execution"],
                             enqueue_s=enqueue_s)
    published = float(row["published"])
    if row["metric"] == "tokens_per_s_per_gpu":
        # static batch: the measured time holds the prefill and output_len - 1 decode steps,
        # which is how serving_time counts its tokens/s
        modelled = r["tokens_per_s_per_gpu"]
        return modelled, modelled / published - 1
    modelled = r["ttft_s"] * 1e3
    return modelled, published / modelled - 1


def runs(use=None, path=None) -> list[dict]:
    """The rows of data/published_serving.csv (or of `path`), as the CSV gives them; only
    those whose `use` is `use` ("check" or "calibration") when given."""
    with open(path or hardware.DATA_DIR / TABLE, newline="") as f:
        return [r for r in csv.DictReader(f) if use in (None, r["use"])]


def check(rows=None, enqueue_s=None) -> list[dict]:
    """Each published row (default: the table's check rows) with its `modelled` value and
    `error`, `published` as a number and `unit` the metric's (METRICS)."""
    out = []
    for row in runs("check") if rows is None else rows:
        modelled, error = predict(row, enqueue_s)
        out.append(dict(row, published=float(row["published"]), modelled=modelled, error=error,
                        unit=METRICS[row["metric"]]))
    return out


def fit_enqueue_s(rows=None, tolerance=1e-8) -> float:
    """The serving model's one fitted number (pricing.ENQUEUE_S): the host's seconds per
    kernel that minimise the calibration rows' squared log error (a ratio off by x either way
    weighs alike; rows the host does not limit weigh nothing on it), by golden-section search
    over 0-100 us. Only `use == calibration` rows are looked at; the check rows stay a test."""
    rows = [r for r in (rows or runs("calibration")) if r["use"] == "calibration"]
    if not rows:
        raise ValueError("no calibration rows to fit on")

    def loss(enqueue_s):
        return sum(math.log1p(r["error"]) ** 2 for r in check(rows, enqueue_s))
    low, high = 0.0, 1e-4
    ratio = (math.sqrt(5) - 1) / 2
    while high - low > tolerance:
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        low, high = (low, b) if loss(a) <= loss(b) else (a, high)
    return float(f"{(low + high) / 2:.2g}")
