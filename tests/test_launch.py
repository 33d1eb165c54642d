"""launch's promises: results by rank, notebook functions, errors, hangs, orphans, ports,
bad arguments, Ctrl-C, a dead parent, and torchrun."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import labkit
from labkit.runtime.launch import LaunchError, check_launch_args, max_cpu_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_and_sum(ctx):
    t = torch.ones(3) * (ctx.rank + 1)
    ctx.comm.all_reduce(t)
    return ctx.rank, ctx.world_size, t[0].item()


def write_pid_then(ctx, folder, action):
    with open(os.path.join(folder, f"pid{ctx.rank}"), "w") as f:
        f.write(str(os.getpid()))
    if action == "raise" and ctx.rank == 2:
        raise ValueError("rank two is broken on purpose")
    if action == "mismatch":
        t = torch.ones(4)
        if ctx.rank == 0:
            ctx.comm.all_reduce(t)
        else:
            ctx.comm.all_gather(t)
    time.sleep(60)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def pids(folder, n):
    """The pids the ranks wrote (a rank stopped early may not have written its own)."""
    files = [os.path.join(folder, f"pid{r}") for r in range(n)]
    return [int(open(f).read()) for f in files if os.path.exists(f)]


def assert_all_gone(folder, n, within=5.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids(folder, n)):
            return
        time.sleep(0.1)
    assert not [p for p in pids(folder, n) if alive(p)], "child ranks outlived the call"


def test_results_come_back_in_rank_order():
    assert labkit.launch(rank_and_sum, 4) == [(r, 4, 10.0) for r in range(4)]


def test_function_defined_in_a_notebook_cell_works():
    # A cell's function lives in __main__, which the ranks cannot import: it goes by value.
    namespace = {"__name__": "__main__"}
    exec(textwrap.dedent("""
        import torch
        SCALE = 3.0
        def cell_fn(ctx):
            t = torch.full((2,), SCALE * ctx.rank)
            ctx.comm.all_reduce(t)
            return t.tolist()
    """), namespace)
    assert labkit.launch(namespace["cell_fn"], 2) == [[3.0, 3.0], [3.0, 3.0]]


def test_a_raising_rank_stops_the_run_fast_with_its_traceback(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        labkit.launch(write_pid_then, 4, str(tmp_path), "raise", timeout_s=60)
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "rank 2 raised" in message and "rank two is broken on purpose" in message
    assert "ValueError" in message
    assert pids(tmp_path, 4)
    assert_all_gone(tmp_path, 4)


def test_mismatched_collectives_time_out_naming_ranks_and_ops(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        labkit.launch(write_pid_then, 3, str(tmp_path), "mismatch", timeout_s=4)
    assert 3.5 < time.monotonic() - start < 15
    message = str(err.value)
    assert "timed out after 4s" in message
    assert "rank 0: all_reduce" in message
    assert "rank 1: all_gather" in message and "rank 2: all_gather" in message
    assert_all_gone(tmp_path, 3)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_world_size_is_refused_before_anything_starts(bad):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        labkit.launch(rank_and_sum, bad)


def test_more_nccl_ranks_than_gpus_is_refused():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank"):
        check_launch_args(gpus + 1, "nccl")


def test_a_world_size_far_above_the_machine_is_refused():
    with pytest.raises(ValueError, match="far more CPU ranks than this machine can hold"):
        labkit.launch(rank_and_sum, max_cpu_ranks() + 1)


def test_a_modelled_cluster_smaller_than_the_world_is_refused():
    with pytest.raises(ValueError, match="has 1 GPUs but world_size=2"):
        labkit.launch(rank_and_sum, 2, cluster="1xRTX4090")


def test_launches_back_to_back_reuse_nothing():
    for _ in range(3):
        assert labkit.launch(rank_and_sum, 2)[1] == (1, 2, 3.0)


SCRIPT = """
import os, sys, time, torch, labkit
def fn(ctx, folder):
    open(os.path.join(folder, f"pid{ctx.rank}"), "w").write(str(os.getpid()))
    if folder.endswith("sleep"):
        time.sleep(60)
    t = torch.ones(2) * ctx.rank
    ctx.comm.all_reduce(t)
    return t.sum().item()
if __name__ == "__main__":
    print("RESULT", labkit.launch(fn, int(sys.argv[2]), sys.argv[1]), flush=True)
"""


def run_script(tmp_path, folder, n, **popen):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    os.makedirs(folder, exist_ok=True)
    return subprocess.Popen([sys.executable, str(script), str(folder), str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_two_launches_at_once_from_two_processes_do_not_collide(tmp_path):
    procs = [run_script(tmp_path, tmp_path / f"run{i}", 2) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "RESULT [2.0, 2.0]" in out


def test_ctrl_c_stops_every_rank(tmp_path):
    folder = tmp_path / "sleep"
    proc = run_script(tmp_path, folder, 3)
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert_all_gone(folder, 3)


def test_ranks_leave_when_the_launching_process_is_killed(tmp_path):
    folder = tmp_path / "sleep"
    proc = run_script(tmp_path, folder, 2)
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.kill()  # SIGKILL: no finally blocks run in the parent
    proc.wait()
    assert_all_gone(folder, 2, within=10)


def test_the_same_script_runs_under_torchrun(tmp_path):
    folder = tmp_path / "torchrun"
    os.makedirs(folder)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(folder), "2"], capture_output=True, text=True, timeout=120,
        cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    # every rank gets all results (the two ranks' prints may interleave)
    assert out.stdout.count("RESULT") == 2 and out.stdout.count("[2.0, 2.0]") == 2


def test_a_script_piped_on_stdin_can_launch(tmp_path):
    code = SCRIPT.replace('if __name__ == "__main__":', 'if True:')
    out = subprocess.run([sys.executable, "-", str(tmp_path), "2"], input=code,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RESULT [2.0, 2.0]" in out.stdout
