"""The serving model against published serving runs: writes data/serving_check.csv and prints
the table with the mean |error| of the check rows and of the calibration rows apart. The
prediction of each row (and what its error means) lives in labkit/theory/published_serving.py;
this script only writes and prints it. `--fit` prints the fitted host time per kernel
(published_serving.fit_enqueue_s, on the calibration rows only) beside the stored one.
Beside each row, `llm-analysis` 0.2.2's inference model (flops_efficiency 0.5 as in
bench/planner.py, its own HBM efficiency 1; fp8 weights and cache as 8-bit, at its 8-bit peak,
twice bf16's): its prefill latency for a TTFT row, batch x output / its total latency / GPUs for
a throughput row, errors as labkit's. Install it as bench/planner.py says.
Run: python bench/serving_check.py [--fit]
"""
from __future__ import annotations

import contextlib
import csv
import io
import logging
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from labkit.theory import hardware, planner, pricing, published_serving  # noqa: E402
from planner import LLM_ANALYSIS_EFFICIENCY, llm_analysis_configs  # noqa: E402

OUT = ROOT / "data" / "serving_check.csv"
COLUMNS = ("name", "use", "gpu", "metric", "published", "modelled", "error", "llm_analysis",
           "llm_analysis_error")


def llm_analysis_metric(r):
    """(llm-analysis's value of row `r`'s metric, its error), or (None, None) where the
    package is not installed or refuses the row."""
    try:
        from llm_analysis import analysis as la
        from llm_analysis.config import DtypeConfig, ParallelismConfig
    except ImportError:
        return None, None
    m, g = planner.parse_model(r["model"]), hardware.gpu(r["gpu"])
    tp, pp, batch = int(r["tp"]), int(r["pp"]), int(r["batch"])
    prompt, output = int(r["input_len"]), int(r["output_len"])
    model, gpu = llm_analysis_configs(r["name"], m, g, prompt + output, g.link,
                                      "InfiniBand NDR", 8)
    bits = 8 if r["weights"] == "fp8" else 16
    analysis = la.LLMAnalysis(model, gpu, DtypeConfig(weight_bits=bits, activation_bits=bits),
                              ParallelismConfig(tp_size=tp, pp_size=pp),
                              flops_efficiency=LLM_ANALYSIS_EFFICIENCY)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            out = analysis.inference(batch_size_per_gpu=batch, seq_len=prompt,
                                     num_tokens_to_generate=output,
                                     kv_cache_dtype_bytes=1 if r["kv_dtype"] == "fp8" else 2)
    except Exception as error:   # its asserts (e.g. a batch that does not fit): none
        print(f"  llm-analysis refused {r['name']}: {str(error)[:80]}")
        return None, None
    published = float(r["published"])
    if r["metric"] == "ttft_ms":
        value = out["prefill_latency"] * 1e3
        return value, published / value - 1
    value = batch * output / out["total_latency"] / (tp * pp)
    return value, value / published - 1


def main() -> None:
    if "--fit" in sys.argv[1:]:
        print(f"enqueue_s fitted on the calibration rows: {published_serving.fit_enqueue_s():.3g}"
              f" s per kernel (stored: {pricing.ENQUEUE_S:.3g})")
    logging.getLogger("llm_analysis").setLevel(logging.ERROR)
    checked = [dict(r, **dict(zip(("llm_analysis", "llm_analysis_error"),
                                  llm_analysis_metric(r))))
               for r in published_serving.check(published_serving.runs())]
    with open(OUT, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
        w.writeheader()
        w.writerows(dict(r, modelled=f"{r['modelled']:.4g}", error=f"{r['error']:.4f}",
                         llm_analysis=_number(r["llm_analysis"], "{:.4g}"),
                         llm_analysis_error=_number(r["llm_analysis_error"], "{:.4f}"))
                    for r in checked)
    print(f"{'row':34s} {'use':11s} {'metric':20s} {'published':>9s} {'labkit':>9s} "
          f"{'error':>7s} {'llm-an.':>9s} {'error':>7s}")
    for r in checked:
        print(f"{r['name']:34s} {r['use']:11s} {r['metric']:20s} {r['published']:9.4g} "
              f"{r['modelled']:9.4g} {r['error']:+7.1%} "
              f"{_number(r['llm_analysis'], '{:9.4g}') or '-':>9s} "
              f"{_number(r['llm_analysis_error'], '{:+7.1%}') or '-':>7s}")
    for use in ("check", "calibration"):
        rows = [r for r in checked if r["use"] == use]
        mean = sum(abs(r["error"]) for r in rows) / len(rows)
        other = [abs(r["llm_analysis_error"]) for r in rows if r["llm_analysis_error"] is not None]
        print(f"{use} rows: mean |error| over {len(rows)} published rows {mean:.1%}, "
              f"largest {max(abs(r['error']) for r in rows):.1%} (modelled values)"
              + (f"; llm-analysis {sum(other) / len(other):.1%} over {len(other)}"
                 if other else ""))


def _number(value, spec):
    return "" if value is None else spec.format(value)


if __name__ == "__main__":
    main()
