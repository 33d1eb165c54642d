"""The planners' expected error band (labkit/theory/error_band.py): taken from the check rows
(a changed row changes it; serving: the published serving runs), printed by `plan` and
`plan --serve`, in their --json as `error_band`, drawn in lessons 06 and 09."""
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib
import pytest

from labkit.cli import main
from labkit.theory import error_band, published, published_serving

matplotlib.use("Agg")
ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def check_rows():
    return published.runs("check")


@pytest.fixture(scope="module")
def training(check_rows):
    return error_band.training_band(check_rows)


@pytest.fixture(scope="module")
def serving():
    return error_band.serving_band()


def test_the_band_is_the_central_spread_of_the_rows():
    rows = [dict(name=f"r{i}", error=e) for i, e in
            enumerate([-0.5, -0.2, -0.1, 0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.9])]
    b = error_band.band(rows)           # 10 rows, 80%: the lowest and the highest dropped
    assert (b["low"], b["high"], b["min"], b["max"]) == (-0.2, 0.3, -0.5, 0.9)
    assert b["inside"] == 8 and b["outside"] == ["r9", "r0"]     # largest |error| first
    assert b["mean_abs"] == pytest.approx(2.5 / 10)
    few = error_band.band(rows[:4])     # too few to drop any: the full range
    assert (few["low"], few["high"], few["inside"]) == (-0.5, 0.0, 4)


def test_only_check_rows_and_each_named(training, check_rows):
    names = {r["name"] for r in training["rows"]}
    assert names == {r["name"] for r in check_rows} and len(names) == training["n"]
    assert not names & {r["name"] for r in published.runs("calibration")}
    # the kernel model (nothing fitted) over-predicts most rows: the band need not hold 0
    assert training["min"] <= training["low"] <= training["high"] <= training["max"]
    assert training["inside"] < training["n"]
    for r in training["rows"]:          # the error is the row's, predicted by the planner
        assert r["error"] == pytest.approx(r["modelled"] / r["reference"] - 1)


def test_changing_a_row_changes_the_band(training, check_rows):
    top = max(training["rows"], key=lambda r: r["error"] if r["name"] not in
              training["outside"] else -1)           # the row that sets the band's high edge
    assert top["error"] == pytest.approx(training["high"])
    rows = copy.deepcopy(check_rows)
    row = next(r for r in rows if r["name"] == top["name"])
    field = "tokens_per_s_per_gpu" if row["tokens_per_s_per_gpu"].strip() else "tflops_per_gpu"
    row[field] = str(float(row[field]) * 3)   # published 3x as fast: a -62% row, the lowest
    moved = error_band.training_band(rows, measured=None)
    assert moved["high"] < training["high"] and moved["min"] < training["min"]
    assert moved["measured"] is None


def test_measured_rows_are_the_profile_against_the_lab_model():
    measured = error_band.load_measured()
    assert measured is not None, "data/profiles/h200.json is the lab's check profile"
    decode = error_band.measured_decode_rows(measured)
    assert len(decode) == len(measured["decode_step_s"])
    for r, m in zip(decode, measured["decode_step_s"]):
        assert r["reference"] == m["seconds"] and r["error"] == pytest.approx(
            m["seconds"] / r["modelled"] - 1) and error_band.MEASURED == r["source"]
    # a faster measured GPU (the profile's peak and bandwidth) is modelled faster still
    profiled = error_band.measured_decode_rows(measured, profiled=True)
    assert all(p["modelled"] != d["modelled"] for p, d in zip(profiled, decode))
    slower = copy.deepcopy(measured)
    slower["decode_step_s"][0]["seconds"] *= 3
    assert error_band.serving_band(measured=slower)["measured"]["max"] > \
        error_band.serving_band(measured=measured)["measured"]["max"]


def test_the_serving_band_is_the_published_serving_check_rows(serving):
    table = published_serving.runs("check")     # the calibration rows fit ENQUEUE_S: not in it
    assert published_serving.runs("calibration")
    assert serving["n"] == len(table) == len(serving["rows"])
    assert [r["name"] for r in serving["rows"]] == [r["name"] for r in table]
    assert {r["kind"] for r in serving["rows"]} == {"throughput", "TTFT"}
    assert "published serving runs" in serving["basis"]
    assert serving["min"] <= serving["low"] <= serving["high"] <= serving["max"]
    # beside it, not in it: the H200's decode steps
    assert serving["measured"]["n"] == len(error_band.load_measured()["decode_step_s"])
    assert not {r["name"] for r in serving["measured"]["rows"]} & {r["name"] for r in table}
    for r in serving["rows"]:           # as rates, modelled / published - 1 is the row's error
        reference, modelled = error_band.rates(r)
        assert modelled / reference - 1 == pytest.approx(r["error"])


def test_changing_a_published_serving_row_changes_the_band(serving):
    top = max((r for r in serving["rows"] if r["name"] not in serving["outside"]),
              key=lambda r: r["error"])                # the row that sets the band's high edge
    assert top["error"] == pytest.approx(serving["high"])
    rows = copy.deepcopy(published_serving.runs("check"))
    row = next(r for r in rows if r["name"] == top["name"])
    # published 3x as fast: throughput 3x, or TTFT a third; the row becomes the lowest
    factor = 3 if row["metric"] == "tokens_per_s_per_gpu" else 1 / 3
    row["published"] = str(float(row["published"]) * factor)
    moved = error_band.serving_band(rows, measured=None)
    assert moved["high"] < serving["high"] and moved["min"] < serving["min"]
    assert moved["measured"] is None


def test_no_rows_refuses_in_one_line():
    with pytest.raises(ValueError, match="at least one check row"):
        error_band.band([])
    with pytest.raises(ValueError, match="metric must be one of"):
        published_serving.predict(dict(published_serving.runs()[0], metric="tokens_per_s"))


def test_a_missing_profile_still_gives_the_published_serving_band(serving):
    b = error_band.serving_band(measured=None)
    assert b["measured"] is None and (b["low"], b["high"], b["n"]) == (
        serving["low"], serving["high"], serving["n"])
    text = error_band.format_band(b)
    assert text[0].startswith(f"expected error {b['low']:+.0%}/{b['high']:+.0%}")
    assert any("measured on one GPU: missing" in line for line in text)


def test_plan_prints_and_returns_the_band(capsys):
    args = ["plan", "--model", "llama-3-8b", "--gpus", "8", "--global-batch", "64", "--top", "1"]
    started = time.process_time()       # CPU time: the shared machine's load does not count
    assert main(args + ["--json"]) == 0
    assert time.process_time() - started < 1.0
    b = json.loads(capsys.readouterr().out)["error_band"]
    assert b["n"] == len(published.runs("check")) and len(b["rows"]) == b["n"]
    assert b["kind"] == "training" and b["measured"]["n"] == 2
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"expected error {b['low']:+.0%}/{b['high']:+.0%}" in text
    assert all(name in text for name in b["outside"]) and error_band.MEASURED in text


def test_plan_serve_prints_and_returns_the_band(capsys):
    args = ["plan", "--serve", "--model", "llama-3-8b", "--gpus", "8", "--top", "1"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    b, best = out["error_band"], out["plans"][0]
    assert b["kind"] == "serving" and b["n"] == len(published_serving.runs("check"))
    assert b["measured"]["n"] == 4 and "decode" in b["measured"]["rows"][0]["name"]
    assert main(args) == 0
    text = capsys.readouterr().out
    line = next(t for t in text.splitlines() if t.startswith("expected error"))
    assert line.startswith(f"expected error {b['low']:+.0%}/{b['high']:+.0%}")
    assert (f"{b['inside']} of the {b['n']} published serving runs (published_serving.csv) "
            "lie inside the band, none was fitted to") in line
    low = best["tokens_per_s_per_gpu"] / (1 + b["high"])
    assert f"output tokens/s per GPU (modelled) would measure about {low:,.0f}-" in text
    assert all(name in text for name in b["outside"]) and error_band.MEASURED in text


def test_plan_with_the_band_imports_no_torch():
    code = ("import sys; from labkit.cli import main; "
            "rc = main(['plan', '--model', 'llama-3-8b', '--gpus', '8', '--global-batch', '64',"
            " '--top', '1']); rc2 = main(['plan', '--serve', '--model', 'llama-3-8b', "
            "'--gpus', '8', '--top', '1']); "
            "assert rc == rc2 == 0 and 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_figure_draws_every_row_and_the_band(training):
    from labkit.viz.planner_widgets import error_band_figure
    calibration = error_band.published_rows(published.runs("calibration"))
    fig = error_band_figure(training, calibration)
    ax = fig.axes[0]
    from matplotlib.collections import PathCollection
    dots = [tuple(c.get_offsets()[0]) for c in ax.collections
            if isinstance(c, PathCollection) and len(c.get_offsets()) == 1]
    assert dots == [(r["reference"], r["modelled"]) for r in training["rows"]]  # x published
    assert any(len(c.get_offsets()) == len(calibration) for c in ax.collections)
    band = ax.collections[0].get_paths()[0].vertices     # the shaded band, low to high
    assert band[:, 1].min() == pytest.approx(ax.get_xlim()[0] * (1 + training["low"]))
    key = fig.texts[0].get_text()
    assert all(r["name"][:52] in key for r in training["rows"])
    fig.canvas.draw()


def test_the_figure_draws_the_serving_rows_as_rates(serving):
    from labkit.viz.planner_widgets import error_band_figure
    fig = error_band_figure(serving, group="kind", unit="rate", model="serving_time")
    ax = fig.axes[0]
    from matplotlib.collections import PathCollection
    dots = [tuple(c.get_offsets()[0]) for c in ax.collections
            if isinstance(c, PathCollection) and len(c.get_offsets()) == 1]
    assert dots == [pytest.approx(error_band.rates(r)) for r in serving["rows"]]
    ttft = next(r for r in serving["rows"] if r["kind"] == "TTFT")   # drawn as 1 / TTFT in 1/s
    assert error_band.rates(ttft)[0] == pytest.approx(1e3 / ttft["reference"])
    labels = ax.get_legend_handles_labels()[1]
    assert "throughput" in labels and "TTFT" in labels
    edges = [ln.get_ydata() for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert [e[0] for e in edges] == pytest.approx(
        [ax.get_xlim()[0] * (1 + serving[k]) for k in ("low", "high")])
    fig.canvas.draw()


def test_a_dots_number_moves_off_a_dot_beside_it():
    from labkit.viz.planner_widgets import _number_places
    dots = [(0.0, 0.0), (5.0, 5.0), (200.0, 0.0)]         # pixels at 72 dpi: 1 px = 1 pt
    places = _number_places(dots, 72)
    assert places[2] == (7.0, 7.0)                         # alone: up-right, as before
    for (x, y), (dx, dy) in zip(dots[:2], places[:2]):     # the pair: each number clear of both
        assert all(((x + dx - a) ** 2 + (y + dy - b) ** 2) ** 0.5 >= 5 for a, b in dots)
