"""The published serving rows load, each names its source, and the check predicts every one."""
import csv
import importlib.util
import math
import pathlib

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
    assert len(rows) >= 8
    for r in rows:
        for key in ("source", "gpu", "model", "weights", "kv_dtype", "tp", "batch",
                    "input_len", "output_len", "metric", "published"):
            assert r[key].strip(), (r["name"], key)
        assert float(r["published"]) > 0


def test_the_check_gives_a_finite_error_for_every_row():
    checked = _bench().rows()
    assert checked and all(math.isfinite(r["error"]) and r["modelled"] > 0 for r in checked)
