"""The serving model against published serving runs (data/published_serving.csv): checks.

Nothing in the serving model is fitted to these rows (TensorRT-LLM's H100 performance tables,
each row with its source). Each is predicted by serving.serving_time with the row's own
settings (GPU, model shape, weights and KV precision, tp, pp, batch, input and output lengths).
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

from . import hardware, serving

TABLE = "published_serving.csv"     # under hardware.DATA_DIR (data/ links to labkit/tables/)
METRICS = {"tokens_per_s_per_gpu": "output tokens/s per GPU", "ttft_ms": "ms to first token"}


def predict(row) -> tuple[float, float]:
    """(modelled, error) of one published row, in the row's own metric (METRICS)."""
    if row["metric"] not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {row['metric']!r}")
    r = serving.serving_time(row["model"], gpu=row["gpu"], tp=int(row["tp"]), pp=int(row["pp"]),
                             batch=int(row["batch"]), prompt_len=int(row["input_len"]),
                             new_tokens=int(row["output_len"]), weights=row["weights"],
                             kv_dtype=row["kv_dtype"])
    published = float(row["published"])
    if row["metric"] == "tokens_per_s_per_gpu":
        # static batch: the measured time holds the prefill and output_len - 1 decode steps,
        # which is how serving_time counts its tokens/s
        modelled = r["tokens_per_s_per_gpu"]
        return modelled, modelled / published - 1
    modelled = r["ttft_s"] * 1e3
    return modelled, published / modelled - 1


def runs(path=None) -> list[dict]:
    """The rows of data/published_serving.csv (or of `path`), as the CSV gives them."""
    with open(path or hardware.DATA_DIR / TABLE, newline="") as f:
        return list(csv.DictReader(f))


def check(rows=None) -> list[dict]:
    """Each published row (default: every row of the table) with its `modelled` value and
    `error`, `published` as a number and `unit` the metric's (METRICS)."""
    out = []
    for row in runs() if rows is None else rows:
        modelled, error = predict(row)
        out.append(dict(row, published=float(row["published"]), modelled=modelled, error=error,
                        unit=METRICS[row["metric"]]))
    return out
