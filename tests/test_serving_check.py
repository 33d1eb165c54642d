"""The published serving rows load, each names its source, the theory predicts every one
(labkit/theory/published_serving.py), and bench/serving_check.py writes that prediction."""
import csv
import importlib.util
import math
import pathlib

import pytest

from labkit.theory import published_serving

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("serving_check",
                                                  ROOT / "bench" / "serving_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_published_serving_row_names_its_source_and_settings():
    with open(ROOT / "labkit" / "tables" / "published_serving.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 8 and rows == published_serving.runs()
    for r in rows:
        for key in ("source", "gpu", "model", "weights", "kv_dtype", "tp", "batch",
                    "input_len", "output_len", "metric", "published"):
            assert r[key].strip(), (r["name"], key)
        assert float(r["published"]) > 0


def test_the_check_gives_a_finite_error_for_every_row():
    checked = published_serving.check()
    assert checked and all(math.isfinite(r["error"]) and r["modelled"] > 0 for r in checked)


def test_a_positive_error_means_the_model_is_optimistic():
    for row in published_serving.runs()[::3]:           # throughput and TTFT rows
        slower = dict(row, published=str(float(row["published"]) * (
            0.5 if row["metric"] == "tokens_per_s_per_gpu" else 2)))    # half the speed
        (m, e), (m2, e2) = published_serving.predict(row), published_serving.predict(slower)
        assert m2 == m and e2 > e, row["name"]


def test_the_bench_writes_the_theory_check(tmp_path, monkeypatch, capsys):
    bench = _bench()
    assert not hasattr(bench, "predict")        # one prediction, in theory/
    monkeypatch.setattr(bench, "OUT", tmp_path / "serving_check.csv")
    bench.main()
    with open(tmp_path / "serving_check.csv", newline="") as f:
        written = list(csv.DictReader(f))
    checked = published_serving.check()
    assert [r["name"] for r in written] == [r["name"] for r in checked]
    for w, r in zip(written, checked):
        assert float(w["error"]) == pytest.approx(r["error"], abs=1e-4)
    mean = sum(abs(r["error"]) for r in checked) / len(checked)
    assert f"mean |error| over {len(checked)} published rows: {mean:.1%}" in capsys.readouterr().out
