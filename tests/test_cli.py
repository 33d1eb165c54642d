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
