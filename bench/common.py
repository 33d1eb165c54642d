"""Shared by the benchmarks: one CSV of results, a median, a header line."""
import csv
import datetime
import os
import statistics

CSV = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                   "bench.csv")
COLUMNS = ["benchmark", "labkit_impl", "torch_impl", "world_size", "metric", "labkit", "torch",
           "ratio", "notes", "date"]


def append_rows(rows):
    """Append result rows (dicts with COLUMNS keys; date is filled in) to data/bench.csv."""
    new = not os.path.exists(CSV)
    with open(CSV, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**{c: "" for c in COLUMNS}, **row,
                             "date": datetime.date.today().isoformat()})


def median(values):
    return statistics.median(values)
