"""calibrate, the hardware profile, plan --gpu-profile and gpu-check, on CPU (issue 32).

What needs CUDA (the timings) runs on the GPU box (`make gpu-check`); here: the refusal without
a GPU, the profile's format and loader, that the plan uses a profile's numbers, and every block
check and the table with device="cpu", backend="gloo".
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from labkit import cli, gpu_check
from labkit.calibrate import LLAMA_1B, WINDOW_S, calls_per_window, modelled, side_by_side
from labkit.runtime import comm
from labkit.theory import hardware
from labkit.theory.profile import check_profile, load_profile, peak_tflops, profiled_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def profile(peak=700.0, hbm=4000.0, gpu="NVIDIA H200"):
    """A profile in calibrate's format (numbers made up for the test, not measured)."""
    return dict(gpu=gpu, torch="2.11.0+cu130", cuda="13.0",
                gemm=[dict(m=8192, n=8192, k=8192, dtype="bf16", tflops=peak),
                      dict(m=1, n=4096, k=4096, dtype="bf16", tflops=peak / 100)],
                hbm_gbps=hbm,
                decode_step_s=[dict(model="llama-1b-shaped", batch=1, context=1024,
                                    seconds=1e-3)],
                train_step_s=[dict(model="llama-1b-shaped", batch=4, seq=2048, seconds=0.1)],
                all_reduce=[])


def write(tmp_path, data, name="p.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_calibrate_without_gpu_says_so_in_one_line(capsys):
    assert cli.main(["calibrate", "--quick"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert len(out.err.strip().splitlines()) == 1 and "no CUDA GPU" in out.err
    assert "Traceback" not in out.err


def test_profile_round_trip_and_peak(tmp_path):
    data = profile(peak=650.0)
    loaded = load_profile(write(tmp_path, data))
    assert loaded == data
    assert peak_tflops(loaded) == 650.0        # the large GEMM, not the skinny one
    g = profiled_gpu(loaded)
    assert g.bf16_flops == 650e12 and g.memory_bw == 4000e9
    assert g.memory_bytes == hardware.gpu("H200").memory_bytes   # the rest: the catalog's


@pytest.mark.parametrize("change, words", [
    (lambda p: p.pop("gemm"), "'gemm' must be a list"),
    (lambda p: p.update(gemm=[]), "no measurement"),
    (lambda p: p.update(hbm_gbps=-1), "'hbm_gbps' must be a positive number"),
    (lambda p: p.update(hbm_gbps=True), "'hbm_gbps' must be a positive number"),
    (lambda p: p["gemm"][0].update(m=0), "gemm[0].m must be a positive integer"),
    (lambda p: p["gemm"][1].pop("tflops"), "gemm[1].tflops must be a positive number"),
    (lambda p: p["train_step_s"].append(3), "train_step_s[1] must be an object"),
    (lambda p: p.update(gpu=None), "'gpu' must be a string"),
])
def test_malformed_profiles_are_refused_in_one_line(tmp_path, change, words):
    data = profile()
    change(data)
    with pytest.raises(ValueError) as error:
        load_profile(write(tmp_path, data))
    message = str(error.value)
    assert words in message and "\n" not in message and "p.json" in message


def test_unreadable_profiles_are_refused_in_one_line(tmp_path):
    for path, words in ((write(tmp_path, "{not json", "a.json"), "not JSON"),
                        (str(tmp_path / "missing.json"), "cannot read"),
                        (write(tmp_path, "[1, 2]", "b.json"), "a JSON object")):
        with pytest.raises(ValueError, match=words):
            load_profile(path)


def plan_json(capsys, path, extra=()):
    assert cli.main(["plan", "--model", "llama-3-8b", "--gpus", "8", "--global-batch", "64",
                     "--fix", "dp=8,tp=1,pp=1", "--json", "--gpu-profile", path, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_uses_the_profiles_numbers(tmp_path, capsys):
    fast = plan_json(capsys, write(tmp_path, profile(peak=800.0), "fast.json"))
    slow = plan_json(capsys, write(tmp_path, profile(peak=400.0), "slow.json"))
    assert fast["gpu_profile"]["peak_bf16_flops"] == 800e12
    assert slow["plans"][0]["step_s"] > 1.5 * fast["plans"][0]["step_s"]   # compute-bound step
    assert "measured" in fast["cluster"]["gpu"]
    assert cli.main(["plan", "--model", "llama-3-8b", "--gpus", "8", "--global-batch", "64",
                     "--gpu-profile", str(tmp_path / "fast.json"), "--top", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("GPU numbers from the profile") and "800.0 TFLOP/s" in header


def test_plan_serve_uses_the_profiles_bandwidth(tmp_path, capsys):
    """Decode at batch 1 reads every weight once: half the measured HBM bandwidth, twice the
    time per output token less its kernel launches (kernels.LAUNCH_S each, 11 per Llama layer
    and 2 for the head, which no bandwidth changes; the serving planner reads the profile too)."""
    from labkit.theory.kernels import LAUNCH_S
    def tpot(hbm):
        path = write(tmp_path, profile(hbm=hbm), f"hbm{hbm}.json")
        assert cli.main(["plan", "--serve", "--model", "llama-3-8b", "--gpus", "1", "--gpu",
                         "H200", "--batch", "1", "--weights", "bf16", "--gpu-profile", path,
                         "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert "measured" in out["cluster"]["gpu"]
        return out["plans"][0]["tpot_s"]
    launches = (32 * 11 + 2) * LAUNCH_S
    assert tpot(2000.0) - launches == pytest.approx(2 * (tpot(4000.0) - launches), rel=0.01)


def test_plan_with_a_bad_profile_is_one_line_and_imports_no_torch(tmp_path):
    bad = write(tmp_path, dict(profile(), hbm_gbps=0))
    good = write(tmp_path, profile(), "good.json")
    code = ("import sys; from labkit.cli import main; "
            f"rc = main(['plan', '--model', 'llama-3-8b', '--gpus', '8', '--global-batch', '64',"
            f" '--gpu-profile', {good!r}, '--top', '1']); "
            "assert rc == 0 and 'torch' not in sys.modules, rc; "
            f"sys.exit(main(['plan', '--model', 'llama-3-8b', '--gpus', '8', '--global-batch',"
            f" '64', '--gpu-profile', {bad!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "hbm_gbps" in done.stderr


def test_measured_beside_modelled():
    data = profile()
    model = modelled(data["gpu"], LLAMA_1B, data["decode_step_s"], data["train_step_s"])
    # decode at batch 1 reads the weights once: at least bytes / HBM of the H200's datasheet
    weights = 2 * (16 * (4 * 2048**2 + 3 * 2048 * 8192) + 2 * 32000 * 2048)
    assert model[("decode", 1, 1024)] >= weights / hardware.gpu("H200").memory_bw
    assert model[("train", 4, 2048)] > 0
    text = "\n".join(side_by_side(data))
    assert "H200" in text and "measured/modelled" in text
    assert modelled("Some Unknown Accelerator", LLAMA_1B, [], []) == {}


def test_the_old_collective_names_are_used_when_the_new_ones_are_missing(monkeypatch):
    assert comm.dist_op("all_gather_single", "all_gather_into_tensor") is \
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    assert comm._all_gather_op() is dist.all_gather_into_tensor
    assert comm.dist_op("reduce_scatter_single", "reduce_scatter_tensor") is \
        dist.reduce_scatter_tensor


def test_a_failing_check_is_one_row_and_the_rest_run():
    rows = []
    gpu_check.attempt(rows, "broken", lambda: 1 / 0)
    gpu_check.attempt(rows, "fine", lambda: gpu_check.row("fine", "PASS", "1", "1", "1.00"))
    gpu_check.attempt(rows, "late", lambda: 1 / 0, gpu_check.Budget(-1))
    assert [r["result"] for r in rows] == ["FAIL", "PASS", "SKIPPED"]
    assert rows[0]["note"] == "ZeroDivisionError: division by zero"
    table = gpu_check.table(rows)
    assert table.splitlines()[0] == "| check | result | measured | modelled | ratio |"
    assert "FAIL (ZeroDivisionError: division by zero)" in table


def test_every_block_on_cpu_gloo_and_the_table(tmp_path):
    rows = gpu_check.gpu_check(str(tmp_path), budget_s=240, device="cpu", backend="gloo")
    by = {r["check"].split(" (")[0]: r for r in rows}
    blocks = ["DataParallel", "ShardedOptimizer", "FullyShard", "parallelize",
              "PipelineStage + 1F1B", "ExpertParallel", "ContextParallel", "serving.generate"]
    for name in blocks:
        assert by[name]["result"] == "PASS", by[name]
    assert by["calibrate --quick"]["result"] == "SKIPPED"
    assert (tmp_path / "table.md").read_text().count("\n") == len(rows) + 2
    assert len(json.loads((tmp_path / "rows.json").read_text())["rows"]) == len(rows)
    assert not (tmp_path / "profile.json").exists()


def test_a_wrong_block_is_caught(monkeypatch):
    """The judge fails a block that changes the result: an extra gradient step counts."""
    def doubled(model, x, y):
        loss = model(x, y)
        (2 * loss).backward()
        return loss
    assert gpu_check.judged("wrong", lambda m: gpu_check.train_losses(m, doubled, "cpu"),
                            gpu_check.gpt, "cpu")["result"] == "FAIL"


@pytest.mark.parametrize("seconds", [1e-7, 4e-5, 3.3e-4, 1e-3, 0.12])
def test_a_short_kernel_is_timed_over_a_full_window(seconds):
    """One short kernel between two CUDA events would time Python's launch latency as well;
    calibrate repeats it back to back until the window reaches WINDOW_S (at most 1000 calls)."""
    calls = calls_per_window(seconds)
    assert 1 <= calls <= 1000
    assert calls * seconds >= WINDOW_S or calls == 1000
    assert calls == 1 or (calls - 1) * seconds < WINDOW_S
