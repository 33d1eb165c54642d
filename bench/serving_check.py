"""The serving model against published serving runs (labkit/tables/published_serving.csv).

Each row is predicted by serving.serving_time with the row's own settings (GPU, model shape,
weights and KV precision, tp, pp, batch, input and output lengths); nothing is fitted to them.
Mapping of the published metric to the model (the rows come from static-batch runs,
TensorRT-LLM gptSessionBenchmark: the whole batch is prefilled, then decoded together):
  - tokens_per_s_per_gpu: batch x output_len / (TTFT + (output_len - 1) x TPOT) / GPUs, i.e.
    prefill included; error = modelled / published - 1;
  - ttft_ms: the modelled TTFT; error = published / modelled - 1.
Either way a positive error means the model is optimistic. Writes data/serving_check.csv and
prints the table with the mean |error|. Run: python bench/serving_check.py
"""
from __future__ import annotations

import csv
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from labkit.theory import serving  # noqa: E402

TABLE = ROOT / "labkit" / "tables" / "published_serving.csv"
OUT = ROOT / "data" / "serving_check.csv"


def predict(row) -> tuple[float, float]:
    """(modelled, error) of one published row, in the row's own metric."""
    tp, pp, batch = int(row["tp"]), int(row["pp"]), int(row["batch"])
    new = int(row["output_len"])
    r = serving.serving_time(row["model"], gpu=row["gpu"], tp=tp, pp=pp, batch=batch,
                             prompt_len=int(row["input_len"]), new_tokens=new,
                             weights=row["weights"], kv_dtype=row["kv_dtype"])
    published = float(row["published"])
    if row["metric"] == "tokens_per_s_per_gpu":
        # static batch: the measured time holds the prefill and new - 1 decode steps
        modelled = batch * new / (r["ttft_s"] + (new - 1) * r["tpot_s"]) / (tp * pp)
        return modelled, modelled / published - 1
    if row["metric"] == "ttft_ms":
        modelled = r["ttft_s"] * 1e3
        return modelled, published / modelled - 1
    raise ValueError(f"metric must be tokens_per_s_per_gpu or ttft_ms, got {row['metric']!r}")


def rows() -> list[dict]:
    """Every published row with its modelled value and error."""
    out = []
    with open(TABLE, newline="") as f:
        for row in csv.DictReader(f):
            modelled, error = predict(row)
            out.append(dict(name=row["name"], gpu=row["gpu"], metric=row["metric"],
                            published=float(row["published"]), modelled=modelled, error=error))
    return out


def main() -> None:
    checked = rows()
    with open(OUT, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(checked[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(dict(r, modelled=f"{r['modelled']:.4g}", error=f"{r['error']:.4f}")
                    for r in checked)
    print(f"{'row':34s} {'metric':22s} {'published':>10s} {'modelled':>10s} {'error':>8s}")
    for r in checked:
        print(f"{r['name']:34s} {r['metric']:22s} {r['published']:10.4g} "
              f"{r['modelled']:10.4g} {r['error']:+8.1%}")
    mean = sum(abs(r["error"]) for r in checked) / len(checked)
    print(f"mean |error| over {len(checked)} published rows: {mean:.1%} (modelled values)")


if __name__ == "__main__":
    main()
