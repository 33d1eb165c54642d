"""bench/common.py: one row per configuration in bench.csv, interleaved rounds, per-round ratios."""
import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import common  # noqa: E402

BASE = dict(benchmark="b", labkit_impl="ours", torch_impl="theirs", world_size=2)


def test_a_rerun_replaces_its_configuration_and_old_names_are_renamed(tmp_path):
    path = tmp_path / "bench.csv"
    path.write_text("benchmark,labkit_impl,torch_impl,world_size,metric,labkit,torch,ratio,"
                    "notes,date\nb,ours,theirs,2,t,1,2,0.50,old,2026-01-01\n"
                    "other,x,y,4,t,3,3,1.00,kept,2026-01-01\n")
    common.replace_rows([dict(BASE, metric="t", labkit=3, torch=2, ratio="1.50"),
                         dict(BASE, metric="mem", labkit=5, torch=5, labkit_over_torch="1.00")],
                        path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == common.COLUMNS
    assert [(r["benchmark"], r["metric"], r["labkit_over_torch"]) for r in rows] == [
        ("b", "t", "1.50"), ("other", "t", "1.00"), ("b", "mem", "1.00")]
    assert rows[1]["notes"] == "kept" and rows[1]["date"] == "2026-01-01"
    with pytest.raises(ValueError, match="unknown bench.csv column"):
        common.replace_rows([dict(BASE, metric="t", speedup=2)], path)


def test_interleaved_rounds_alternate_and_skip_the_warmup():
    calls = []

    def side(name, value):
        return lambda: calls.append(name) or value

    out = common.interleaved_rounds({"a": side("a", 2.0), "b": side("b", 4.0)}, rounds=5,
                                    warmup=1)
    assert calls == ["a", "b", "b", "a"] * 3
    assert out == {"a": [2.0] * 5, "b": [4.0] * 5}
    with pytest.raises(ValueError):
        common.interleaved_rounds({"a": side("a", 1)}, rounds=3)


def test_summary_is_the_median_per_round_ratio_with_its_spread():
    row = common.compared_row(BASE, "t", [1, 2, 3, 4, 10], [2, 2, 2, 2, 2], notes="n")
    # per-round ratios 0.5, 1, 1.5, 2, 5: median 1.5, spread 0.5-5; medians 3 and 2
    assert (row["labkit_over_torch"], row["spread_min"], row["spread_max"]) == ("1.50", "0.50",
                                                                                "5.00")
    assert row["labkit"] == "3.0000e+00" and row["torch"] == "2.0000e+00" and row["rounds"] == 5
