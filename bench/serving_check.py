"""The serving model against published serving runs: writes data/serving_check.csv and prints
the table with the mean |error|. The prediction of each row (and what its error means) lives
in labkit/theory/published_serving.py; this script only writes and prints it.
Run: python bench/serving_check.py
"""
from __future__ import annotations

import csv
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from labkit.theory import published_serving  # noqa: E402

OUT = ROOT / "data" / "serving_check.csv"
COLUMNS = ("name", "gpu", "metric", "published", "modelled", "error")


def main() -> None:
    checked = published_serving.check()
    with open(OUT, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
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
