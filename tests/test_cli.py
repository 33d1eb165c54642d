"""python -m labkit: doctor, the single-device reference report, memory of a real model."""
import json
import subprocess
import sys

import pytest

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
