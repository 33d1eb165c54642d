"""The published serving rows load, each names its source, the theory predicts every one
(labkit/theory/published_serving.py), and bench/serving_check.py writes that prediction."""
import csv
import importlib.util
import math
import pathlib

import pytest

from labkit.theory import pricing, published_serving, serving

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
                    "input_len", "output_len", "metric", "published", "use", "execution"):
            assert r[key].strip(), (r["name"], key)
        assert float(r["published"]) > 0
        assert r["use"] in ("check", "calibration") and r["execution"] in pricing.EXECUTIONS


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
    checked = published_serving.check(published_serving.runs())    # both uses, each labelled
    assert [r["name"] for r in written] == [r["name"] for r in checked]
    for w, r in zip(written, checked):
        assert float(w["error"]) == pytest.approx(r["error"], abs=1e-4)
        assert w["use"] == r["use"]
    out = capsys.readouterr().out
    for use in ("check", "calibration"):
        rows = [r for r in checked if r["use"] == use]
        mean = sum(abs(r["error"]) for r in rows) / len(rows)
        assert f"{use} rows: mean |error| over {len(rows)} published rows {mean:.1%}" in out


# ------------------------------------------------------------------ the one fitted serving number

def test_the_stored_host_time_per_kernel_is_the_fit_on_the_calibration_rows_only():
    assert pricing.ENQUEUE_S == published_serving.fit_enqueue_s()
    # the check rows play no part: publishing them 3x slower leaves the fit where it was
    rows = [dict(r, published=str(3 * float(r["published"]))) if r["use"] == "check" else r
            for r in published_serving.runs()]
    assert published_serving.fit_enqueue_s(rows) == pricing.ENQUEUE_S
    # the calibration rows do: a 128-token prefill published 2x slower asks for more host time
    slower = [dict(r, published=str(2 * float(r["published"])))
              if r["use"] == "calibration" and r["input_len"] == "128" else r
              for r in published_serving.runs("calibration")]
    assert published_serving.fit_enqueue_s(slower) > 1.5 * pricing.ENQUEUE_S
    with pytest.raises(ValueError, match="no calibration rows"):
        published_serving.fit_enqueue_s(published_serving.runs("check"))


LLAMA_7B = "layers=32,hidden=4096,heads=32,kv_heads=32,ffn=11008,vocab=32000,arch=llama"


def _ttft(execution, prompt, enqueue_s=None, tp=1):
    return serving.serving_time(LLAMA_7B, gpu="H100", tp=tp, batch=1, prompt_len=prompt,
                                new_tokens=1, weights="fp8", kv_dtype="fp8",
                                execution=execution, enqueue_s=enqueue_s)["ttft_s"]


def test_a_graph_replay_hides_the_host_and_enqueueing_shows_it_only_when_slower():
    assert _ttft("graph", 128, enqueue_s=1.0) == _ttft("graph", 128, enqueue_s=0.0)
    # a short prefill is host-bound when enqueued kernel by kernel: kernels x ENQUEUE_S
    fast, slow = _ttft("graph", 128), _ttft("enqueue", 128)
    kernels = 32 * 11 + 2                               # 11 kernels a Llama layer, 2 the head
    assert slow == pytest.approx(kernels * pricing.ENQUEUE_S) and slow > fast
    # a long one keeps the GPU busier than the host: the same either way
    assert _ttft("enqueue", 4096) == _ttft("graph", 4096)
    # TP adds its all-reduces (2 a layer) to what the host enqueues
    assert _ttft("enqueue", 128, tp=2) == pytest.approx((kernels + 64) * pricing.ENQUEUE_S)
    with pytest.raises(ValueError, match="execution must be one of"):
        _ttft("eager", 128)


def test_the_host_only_ever_slows_a_step():
    for prompt in (1, 16, 128, 512, 2048):
        for enqueue_s in (0.0, 1e-6, 1e-5, 1e-4):
            assert _ttft("enqueue", prompt, enqueue_s) >= _ttft("graph", prompt)
            more = 2 * enqueue_s + 1e-6
            assert _ttft("enqueue", prompt, enqueue_s) <= _ttft("enqueue", prompt, more)


def test_plan_serve_enforce_eager_prices_the_host_in_both_planners(capsys):
    import json

    from labkit.cli import main

    def run(*extra):
        args = ["plan", "--serve", "--model", "llama-3-8b", "--gpus", "1", "--prompt-len",
                "128", "--new-tokens", "8", "--json", *extra]
        assert main(args) == 0
        return json.loads(capsys.readouterr().out)
    layout = ["--fix", "tp=1,pp=1,ep=1,replicas=1", "--weights", "bf16"]
    graph, eager = run(*layout), run(*layout, "--enforce-eager")
    assert eager["workload"]["execution"] == "enqueue" and graph["workload"]["execution"] == "graph"
    assert eager["plans"][0]["ttft_s"] == pytest.approx((32 * 11 + 2) * pricing.ENQUEUE_S)
    assert eager["plans"][0]["ttft_s"] > graph["plans"][0]["ttft_s"]
    stream = ["--rate", "2", "--requests", "8"]
    graph, eager = run(*stream), run(*stream, "--enforce-eager")
    assert eager["workload"]["execution"] == "enqueue"
    mean = lambda out: sum(p["latency"]["tpot_s"]["mean"] for p in out["policies"])  # noqa: E731
    assert mean(eager) > mean(graph)
