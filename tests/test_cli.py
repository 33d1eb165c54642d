"""python -m labkit: doctor, the single-device reference report, memory of a real model,
one-line answers to mistakes, and Ctrl-C."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from labkit.cli import main

REPORT_KEYS = {"technique", "world_size", "backend", "config", "steps", "loss", "reference_loss",
               "max_param_diff_vs_reference", "memory", "predicted_memory", "comm",
               "predicted_comm_bytes_per_rank", "wall_s", "modelled_step_s"}


def labkit(*args, check=True):
    out = subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                         text=True, timeout=120)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_doctor_names_torch_and_the_backends():
    out = labkit("doctor").stdout
    assert "torch" in out and "2.13" in out and "gloo" in out and "cpu cores" in out


def test_run_single_json_is_the_reference_report():
    report = json.loads(labkit("run", "single", "--steps", "2", "--json").stdout)
    assert REPORT_KEYS <= set(report)
    assert report["technique"] == "single" and report["world_size"] == 1
    assert report["loss"] == report["reference_loss"] and len(report["loss"]) == 2
    assert report["max_param_diff_vs_reference"] == 0.0
    measured, predicted = report["memory"]["0"], report["predicted_memory"]
    for category in ("params", "grads", "optimizer"):
        assert measured[category] == predicted[category]
    assert measured["activations"] == pytest.approx(predicted["activations"], rel=0.15)
    assert report["modelled_step_s"] > 0


def test_run_single_refuses_more_than_one_rank():
    out = labkit("run", "single", "--world-size", "2", check=False)
    assert out.returncode != 0 and "exactly one rank" in out.stderr


def test_memory_of_llama_3_70b():
    out = labkit("memory", "--model", "llama-3-70b").stdout
    assert "70.55B parameters" in out
    assert "141.1 GB" in out  # bf16 weights


def test_memory_of_an_unknown_model_says_which_exist():
    out = labkit("memory", "--model", "gpt-17", check=False)
    assert out.returncode != 0 and "llama-3-70b" in out.stderr


@pytest.mark.parametrize("args, flag", [
    (["memory", "--gpus", "0"], "--gpus"),
    (["memory", "--batch", "-2"], "--batch"),
    (["memory", "--seq", "0"], "--seq"),
    (["run", "single", "--steps", "0"], "--steps"),
    (["run", "single", "--batch", "0"], "--batch"),
    (["run", "dp", "--world-size", "-1"], "--world-size"),
])
def test_counts_of_zero_or_less_get_one_line_and_exit_code_2(args, flag, capsys):
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert err == f"error: {flag} must be a positive integer, got {args[-1]}\n" and out == ""


def forkserver_of(pid):
    """The forkserver a process started (its child running multiprocessing.forkserver)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if parent == pid and b"forkserver" in f.read():
                    return int(name)
        except (OSError, IndexError, ValueError):
            pass
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_during_the_first_start_prints_one_line_and_exits_130():
    # As a terminal does: SIGINT to the whole process group, while the forkserver that the
    # first launch started still imports torch.
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "run", "single", "--steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # SIGINT at its default even if we ignore it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while forkserver_of(proc.pid) is None and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    assert forkserver_of(proc.pid) is not None, "the run never started its ranks"
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "interrupted (Ctrl-C)\n" and out == ""


# --------------------------------------------------- mistakes off the trodden path (issue 33)

@pytest.fixture
def no_ranks(monkeypatch):
    """Any rank started fails the test: these mistakes must end before a launch."""
    import labkit.runtime.launch as launch_module

    def refuse():
        raise AssertionError("a rank process was asked for")
    monkeypatch.setattr(launch_module, "mp_context", refuse)


@pytest.mark.parametrize("args, words", [
    (["--prompt-len", "100000"], "run serve needs about 2.56 TB but"),
    (["--new-tokens", "100000"], "run serve would take at least"),
    (["--batch", "10000000"], "run serve needs about"),
])
def test_run_serve_that_cannot_fit_or_end_is_refused_in_one_line(args, words, no_ranks, capsys):
    start = time.monotonic()
    assert main(["run", "serve", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {words}") and err.count("\n") == 1, err
    assert "choose a smaller shape, batch, prompt or fewer new tokens" in err
    assert time.monotonic() - start < 20


def test_run_serve_with_100000_layers_is_refused_without_building_them(no_ranks, capsys):
    from labkit.runs import serve, serve_fit
    start = time.monotonic()
    cfg = serve.ServeConfig(model_kwargs=dict(layers=100000))
    with pytest.raises(ValueError) as err:   # on a machine with 16 GB available
        serve_fit.check_fits(cfg, timeout_s=300, available=16e9)
    assert str(err.value).startswith("run serve needs about 29.8 GB but 16.0 GB is available: "
                                     "1 rank(s) x 29.8 GB (weights 20.0 GB + KV cache 9.4 GB")
    serve.check_config(serve.ServeConfig(model_kwargs=dict(layers=2000)), timeout_s=None)
    assert time.monotonic() - start < 10   # the layout check builds two meta blocks, not 2000


@pytest.mark.parametrize("shape", [dict(), dict(batch=2, prompt_len=5, new_tokens=3),
                                   dict(experts=4, top_k=2, new_tokens=2)])
def test_the_serve_estimate_counts_what_the_generation_does(shape):
    # FLOPs as torch counts the reference generation's matmuls; KV-cache bytes as measured
    from torch.utils.flop_counter import FlopCounterMode
    from labkit.runs import serve, serve_fit
    cfg = serve.ServeConfig(**shape)
    with FlopCounterMode(display=False) as counted:
        ref = serve.reference(cfg)
    assert serve_fit.work_flops(cfg) == counted.get_total_flops()
    assert serve_fit.memory(cfg)["parts"]["kv_cache"] == ref["kv_cache_bytes"]
    assert serve_fit.seconds(cfg)["seconds"] < 300 < serve_fit.seconds(
        serve.ServeConfig(**dict(shape, new_tokens=100000)))["seconds"]


@pytest.mark.parametrize("where, words", [
    ("folder", "is a folder; give a file name"),
    ("/proc/labkit-trace.json", "cannot be written"),
    ("missing/trace.json", "its folder does not exist"),
])
def test_a_trace_path_that_cannot_take_a_file_is_refused_before_the_run(where, words, tmp_path,
                                                                         no_ranks, capsys):
    path = str(tmp_path) if where == "folder" else (
        str(tmp_path / where) if where.startswith("missing") else where)
    if where.startswith("/proc") and not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    assert main(["run", "single", "--trace", path]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: --trace {path}: {words}") and \
        err.count("\n") == 1, err


def test_check_writable_leaves_no_file_behind_and_an_existing_one_untouched(tmp_path):
    from labkit.cli_output import check_writable
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("kept")
    check_writable(str(new), "--trace")
    check_writable(str(old), "--trace")
    assert not new.exists() and old.read_text() == "kept"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a full disk)")
def test_a_trace_that_cannot_be_written_after_the_run_is_one_line_and_the_report_survives(capsys):
    assert main(["run", "single", "--steps", "1", "--json", "--trace", "/dev/full"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["technique"] == "single"
    assert err == ("error: --trace /dev/full: the trace could not be written (No space left "
                   "on device); the report is on stdout\n")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a full disk)")
def test_a_report_that_stdout_cannot_take_is_one_line_and_exit_1(monkeypatch, capsys):
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        code = main(["memory", "--model", "llama-3-70b"])
        monkeypatch.undo()
    assert code == 1
    assert capsys.readouterr().err == ("error: the report could not be written to stdout (No "
                                       "space left on device)\n")


def test_a_closed_stdout_is_refused_before_anything_runs():
    out = subprocess.run(f"{sys.executable} -m labkit memory >&-", shell=True, text=True,
                         capture_output=False, stderr=subprocess.PIPE, timeout=120)
    assert out.returncode == 2
    assert out.stderr == ("error: stdout is closed, so the report would be lost: give the "
                          "command an output (a terminal, a file or a pipe)\n")


def test_a_diverged_run_exits_1_naming_the_step_of_its_first_non_finite_loss(capsys):
    assert main(["run", "single", "--steps", "3", "--lr", "1e30", "--json"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    step = next(i for i, x in enumerate(report["loss"]) if x is None)   # NaN/inf -> null
    assert err.startswith(f"error: the run diverged: its loss is ") and err.count("\n") == 1
    assert f" at step {step} (the first non-finite loss); lower --lr (it was 1e+30)" in err


def test_the_reference_out_of_memory_in_this_process_is_one_line(monkeypatch, capsys):
    import torch
    from labkit.runs import single

    def too_big(cfg):
        return torch.empty(2 ** 60, dtype=torch.uint8)
    monkeypatch.setattr(single, "train", too_big)
    monkeypatch.setattr(single, "launch", lambda *a, **k: [None])
    assert main(["run", "single", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this process ran out of memory: it asked for "
                          "1,152,921,504,606,846,976 bytes") and err.count("\n") == 1
