"""Mistakes the CLI answers in one line before any rank starts (labkit/runs/preflight.py), a
JSON report that stays JSON whatever the numbers, and commands that never import torch."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from labkit.cli import main
from labkit.runs import preflight
from labkit.runs.reference import RunConfig
from labkit.runs.report import to_json
from labkit.runtime import cpus

ENV = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REFUSED = [
    (["run", "hybrid", "--dp", "2", "--tp", "2", "--pp", "2", "--layers", "100000"],
     "GB is available"),
    (["run", "hybrid", "--hidden", "100000"], "GB is available"),
    (["run", "cp", "--world-size", "2", "--seq", "100000"], "GB is available"),
    (["run", "hybrid", "--layers", "9" * 400], "too large for any memory"),
    (["run", "dp", "--lr", "nan"], "--lr must be a positive finite number"),
    (["run", "dp", "--lr", "inf"], "--lr must be a positive finite number"),
    (["run", "single", "--lr", "-1"], "--lr must be a positive finite number"),
    (["run", "dp", "--bucket-mb", "-1"], "--bucket-mb must be a positive number"),
    (["run", "moe", "--ep", "0"], "--ep must be a positive integer"),
    (["run", "hybrid", "--virtual", "3", "--schedule", "gpipe"], "--schedule interleaved"),
    (["run", "pipeline", "--virtual", "3", "--schedule", "1f1b"], "--schedule interleaved"),
]


@pytest.fixture
def no_rank_may_start(monkeypatch):
    import labkit.runtime.launch as launch_module

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started for a run the preflight should refuse")
    monkeypatch.setattr(launch_module, "launch", refuse)


@pytest.mark.parametrize("args, says", REFUSED, ids=[" ".join(a)[:60] for a, _ in REFUSED])
def test_refused_in_one_line_before_any_rank(args, says, capsys, no_rank_may_start):
    started = time.monotonic()
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    assert says in err
    assert time.monotonic() - started < 10


def test_a_run_too_large_names_its_need_and_what_is_available(capsys, no_rank_may_start):
    main(["run", "hybrid", "--layers", "100000"])
    err = capsys.readouterr().err
    # 8 ranks, each at least the whole fp32 model it builds: 4 bytes x parameters
    from labkit.models import GPTConfig
    whole_model_gb = 4 * GPTConfig(layers=100000).param_count() / 1e9
    need = float(err.split("needs about ")[1].split(" GB")[0])
    available = float(err.split(" but ")[1].split(" GB")[0])
    assert need >= 8 * whole_model_gb
    assert available == pytest.approx(cpus.available_memory() / 1e9, abs=2.0)


@pytest.mark.parametrize("technique, driver", [("dp", "data_parallel"), ("zero", "zero"),
                                               ("pipeline", "pipeline")])
def test_a_driver_called_directly_refuses_as_the_cli_does(technique, driver, capsys,
                                                           no_rank_may_start):
    import importlib
    module = importlib.import_module(f"labkit.runs.{driver}")
    huge = RunConfig(model_kwargs=dict(layers=100000))   # ~10^11 parameters on every rank
    started = time.monotonic()
    with pytest.raises(ValueError, match="GB is available") as refused:
        module.report(world_size=2, cfg=huge)
    assert "\n" not in str(refused.value)
    assert time.monotonic() - started < 10   # no model of that size was built
    assert main(["run", technique, "--world-size", "2", "--layers", "100000"]) == 2
    assert capsys.readouterr().err == f"error: {refused.value}\n"


def test_the_cli_refuses_in_a_fresh_process_within_seconds():
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "labkit", "run", "cp", "--world-size", "2",
                          "--seq", "100000"], capture_output=True, text=True, timeout=120,
                         env=ENV)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert time.monotonic() - started < 60   # torch's import, under load; no rank started


def test_the_defaults_fit_and_the_estimate_grows_with_the_shape():
    small, big = RunConfig(), RunConfig(model_kwargs=dict(layers=64))
    for technique, world, options in [("single", 1, {}), ("dp", 2, {}), ("zero", 2, {}),
                                      ("tp", 2, {}), ("pipeline", 2, {}), ("cp", 2, {}),
                                      ("moe", 2, {"experts": 4}), ("hybrid", None, {})]:
        preflight.check_run(technique, small, world, options)   # no error
        a = preflight.estimate(technique, small, world, options)
        b = preflight.estimate(technique, big, world, options)
        assert b["per_rank"] > a["per_rank"] and b["reference"] > a["reference"]
        assert a["per_rank"] > cpus.BYTES_PER_CPU_RANK
    with pytest.raises(ValueError, match="needs about"):
        preflight.check_fits("dp", small, 2, {}, available=cpus.BYTES_PER_CPU_RANK)


def test_sharding_lowers_each_ranks_estimate():
    cfg = RunConfig(model_kwargs=dict(layers=8, hidden=256, heads=4, ffn=1024))
    one = preflight.estimate("zero", cfg, 4, {"stage": 0})["per_rank"]
    three = preflight.estimate("zero", cfg, 4, {"stage": 3})["per_rank"]
    assert three < one


def test_json_report_is_valid_json_whatever_the_numbers():
    report = dict(technique="dp", loss=[1.0, float("nan"), float("inf")],
                  memory={0: dict(peak=-math.inf)}, params=None,
                  grad=torch.tensor([1.0, float("nan")]), wall_s=2.5, timeline=[])

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")
    data = json.loads(to_json(report), parse_constant=no_constants)
    assert data["loss"] == [1.0, None, None] and data["grad"] == [1.0, None]
    assert data["memory"]["0"]["peak"] is None and data["wall_s"] == 2.5
    assert data["non_finite"] == ["loss[1]", "loss[2]", "memory.0.peak", "grad[1]"]
    finite = json.loads(to_json(dict(report, loss=[1.0], memory={}, grad=[2.0])))
    assert "non_finite" not in finite


TORCH_FREE = [["--help"], ["run", "--help"], ["doctor", "--help"], ["memory", "--help"],
              ["plan", "--help"], ["memory", "--model", "llama-3-8b"],
              ["plan", "--model", "llama-3-8b", "--gpus", "8", "--global-batch", "64"]]


@pytest.mark.parametrize("args", TORCH_FREE, ids=" ".join)
def test_help_plan_and_memory_never_import_torch(args):
    probe = ("import runpy, sys\nsys.argv = ['labkit'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('labkit', run_name='__main__', alter_sys=True)\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print('exit', code, 'torch' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True,
                         timeout=60, env=ENV)
    assert out.stderr.strip().splitlines()[-1] == "exit 0 False", out.stderr
    if args == ["--help"]:
        assert "plan" in out.stdout and "memory" in out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals a process group")
def test_ctrl_c_while_torch_imports_prints_interrupted_and_exits_130():
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "run", "single"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.6)   # the interpreter is up; torch takes seconds to import
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "interrupted (Ctrl-C)\n", err
