"""The serving model against published serving runs: writes data/serving_check.csv and prints
the table with the mean |error| of the check rows and of the calibration rows apart. The
prediction of each row (and what its error means) lives in labkit/theory/published_serving.py;
this script only writes and prints it. `--fit` prints the fitted host time per kernel
(published_serving.fit_enqueue_s, on the calibration rows only) beside the stored one.
Run: python bench/serving_check.py [--fit]
"""
from __future__ import annotations

import csv
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from labkit.theory import pricing, published_serving  # noqa: E402

OUT = ROOT / "data" / "serving_check.csv"
COLUMNS = ("name", "use", "gpu", "metric", "published", "modelled", "error")


def main() -> None:
    if "--fit" in sys.argv[1:]:
        print(f"enqueue_s fitted on the calibration rows: {published_serving.fit_enqueue_s():.3g}"
              f" s per kernel (stored: {pricing.ENQUEUE_S:.3g})")
    checked = published_serving.check(published_serving.runs())
    with open(OUT, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
        w.writeheader()
        w.writerows(dict(r, modelled=f"{r['modelled']:.4g}", error=f"{r['error']:.4f}")
                    for r in checked)
    print(f"{'row':34s} {'use':11s} {'metric':22s} {'published':>10s} {'modelled':>10s} {'error':>8s}")
    for r in checked:
        print(f"{r['name']:34s} {r['use']:11s} {r['metric']:22s} {r['published']:10.4g} "
              f"{r['modelled']:10.4g} {r['error']:+8.1%}")
    for use in ("check", "calibration"):
        rows = [r for r in checked if r["use"] == use]
        mean = sum(abs(r["error"]) for r in rows) / len(rows)
        print(f"{use} rows: mean |error| over {len(rows)} published rows {mean:.1%}, "
              f"largest {max(abs(r['error']) for r in rows):.1%} (modelled values)")


if __name__ == "__main__":
    main()
