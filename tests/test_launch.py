"""launch's promises: results by rank, notebook functions, errors, hangs, orphans, ports,
bad arguments, Ctrl-C (also during the cold start), a dead parent, the CPUs it may use, and
torchrun."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch

import labkit
from labkit.runtime.cpus import cgroup_cpu_quota, usable_cpus
from labkit.runtime.launch import LaunchError, check_launch_args, check_timeout, max_cpu_ranks

launch_module = sys.modules["labkit.runtime.launch"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def warm_forkserver():
    """The first launch in a process waits for the forkserver's torch import (seconds, tens
    under load): pay it here, so that the time budgets below measure launch itself."""
    labkit.launch(rank_and_sum, 2)


def rank_and_sum(ctx):
    t = torch.ones(3) * (ctx.rank + 1)
    ctx.comm.all_reduce(t)
    return ctx.rank, ctx.world_size, t[0].item()


def write_pid(folder, rank):
    """Written whole or not at all: a rank killed mid-write leaves no empty file."""
    path = os.path.join(folder, f"pid{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def write_pid_then(ctx, folder, action):
    write_pid(folder, ctx.rank)
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
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pids(folder, n):
    """The pids the ranks wrote (a rank stopped early may not have written its own)."""
    files = [os.path.join(folder, f"pid{r}") for r in range(n)]
    return [int(open(f).read()) for f in files if os.path.exists(f)]


def assert_all_gone(folder, n, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids(folder, n)):
            return
        time.sleep(0.1)
    assert not [p for p in pids(folder, n) if alive(p)], "child ranks outlived the call"


def wait_for_pids(folder, n, within=120.0):
    """Wait until all n ranks wrote their pid (a cold start takes tens of seconds under load)."""
    deadline = time.monotonic() + within
    while len(pids(folder, n)) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(pids(folder, n)) == n, f"only {len(pids(folder, n))} of {n} ranks started"


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
    assert time.monotonic() - start < 20
    message = str(err.value)
    assert "rank 2 raised" in message and "rank two is broken on purpose" in message
    assert "ValueError" in message
    assert pids(tmp_path, 4)
    assert_all_gone(tmp_path, 4)


def test_mismatched_collectives_time_out_as_a_deadlock_naming_ranks_and_ops(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        labkit.launch(write_pid_then, 3, str(tmp_path), "mismatch", timeout_s=4)
    assert 3.5 < time.monotonic() - start < 25
    message = str(err.value)
    assert "timed out after 4s" in message and "deadlock" in message.lower()
    assert "rank 0: all_reduce" in message
    assert "rank 1: all_gather" in message and "rank 2: all_gather" in message
    assert_all_gone(tmp_path, 3)


def test_a_slow_run_times_out_as_still_computing_not_a_deadlock(tmp_path):
    with pytest.raises(LaunchError) as err:
        labkit.launch(write_pid_then, 2, str(tmp_path), "sleep", timeout_s=2)
    message = str(err.value)
    assert "timed out after 2s" in message and "still computing" in message
    assert "deadlock" not in message.lower()
    assert_all_gone(tmp_path, 2)


def test_timeout_none_means_no_timeout():
    assert labkit.launch(rank_and_sum, 2, timeout_s=None)[1] == (1, 2, 3.0)
    assert check_timeout(None) is None and check_timeout(float("inf")) is None


@pytest.mark.parametrize("bad", [0, -5, float("nan"), "60", True])
def test_a_timeout_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        labkit.launch(rank_and_sum, 2, timeout_s=bad)


def launch_inside(ctx):
    return labkit.launch(rank_and_sum, 2)


def test_launch_inside_a_rank_says_it_cannot_be_nested():
    with pytest.raises(LaunchError, match="launch cannot be nested") as err:
        labkit.launch(launch_inside, 2)
    assert "AssertionError" not in str(err.value)


def _refuse_to_load():
    raise RuntimeError("this object cannot be rebuilt")


class Unloadable:
    """Pickles fine on the rank, fails when the launching process unpickles it."""
    def __reduce__(self):
        return _refuse_to_load, ()


def unloadable_on_rank_1(ctx):
    return Unloadable() if ctx.rank == 1 else "fine"


def test_a_result_that_cannot_be_unpickled_names_its_rank():
    with pytest.raises(LaunchError, match="rank 1's result cannot be unpickled") as err:
        labkit.launch(unloadable_on_rank_1, 2)
    assert "this object cannot be rebuilt" in str(err.value)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_world_size_is_refused_before_anything_starts(bad):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        labkit.launch(rank_and_sum, bad)


def test_more_nccl_ranks_than_gpus_is_refused():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank"):
        check_launch_args(gpus + 1, "nccl")


def test_a_world_size_far_above_the_machine_is_refused():
    with pytest.raises(ValueError, match="more CPU ranks than this machine can hold"):
        labkit.launch(rank_and_sum, max_cpu_ranks() + 1)


def test_a_modelled_cluster_smaller_than_the_world_is_refused():
    with pytest.raises(ValueError, match="has 1 GPUs but world_size=2"):
        labkit.launch(rank_and_sum, 2, cluster="1xRTX4090")


def test_launches_back_to_back_reuse_nothing():
    for _ in range(3):
        assert labkit.launch(rank_and_sum, 2)[1] == (1, 2, 3.0)


def test_a_launch_removes_the_store_folders_of_launches_killed_outright():
    # A launcher killed by SIGKILL runs no cleanup: its folder waits for the next launch.
    gone = subprocess.Popen(["true"])
    gone.wait()
    from labkit.runtime.processes import mark_store_folder
    dead = tempfile.mkdtemp(prefix=f"labkit-store-{gone.pid}-")
    mark_store_folder(dead, pid=gone.pid)     # what the killed launch wrote
    live = tempfile.mkdtemp(prefix=f"labkit-store-{os.getpid()}-")  # as if launching now
    mark_store_folder(live)
    unmarked = tempfile.mkdtemp(prefix=f"labkit-store-{gone.pid}-")  # not provably labkit's
    try:
        labkit.launch(rank_and_sum, 2)
        assert not os.path.exists(dead) and os.path.isdir(live) and os.path.isdir(unmarked)
    finally:
        for folder in (dead, live, unmarked):
            shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------ the CPUs a rank may use

def threads(ctx):
    return torch.get_num_threads()


def test_ranks_threads_come_from_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.setattr(launch_module, "usable_cpus", lambda: 1)  # e.g. taskset -c 0
    assert labkit.launch(threads, 1) == [1]
    monkeypatch.setattr(launch_module, "usable_cpus", lambda: 6)
    assert labkit.launch(threads, 2) == [3, 3]


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "150000 100000\n"}, 1.5),                        # cgroup v2, 1.5 CPUs
    ({"cpu.max": "max 100000\n"}, None),                          # v2, no limit
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),                                                   # no cgroup files at all
])
def test_a_cgroup_cpu_quota_is_read(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(str(tmp_path)) == quota


def test_a_cgroup_quota_caps_the_usable_cpus(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert usable_cpus(str(tmp_path)) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(str(tmp_path)) == 64


# --------------------------------------------------- scripts: other processes, Ctrl-C, torchrun

SCRIPT = """
import os, sys, time, torch, labkit
def fn(ctx, folder):
    path = os.path.join(folder, f"pid{ctx.rank}")
    open(path + ".tmp", "w").write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    if folder.endswith("sleep"):
        time.sleep(60)
    t = torch.ones(2) * ctx.rank
    ctx.comm.all_reduce(t)
    return t.sum().item()
if __name__ == "__main__":
    print("RESULT", labkit.launch(fn, int(sys.argv[2]), sys.argv[1]), flush=True)
"""


def sigint_as_a_terminal_gives_it():
    """For a child that must take Ctrl-C: SIGINT at its default, also when this test run
    ignores it (started in the background or under nohup: children inherit an ignored SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_script(tmp_path, folder, n, **popen):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    os.makedirs(folder, exist_ok=True)
    return subprocess.Popen([sys.executable, str(script), str(folder), str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_a_terminal_gives_it, **popen)


def test_two_processes_launch_at_once_one_a_script_piped_on_stdin(tmp_path):
    # No shared port or file between two launches; with `python - <<EOF` the main "file" is
    # <stdin>, which the ranks cannot re-import.
    from_file = run_script(tmp_path, tmp_path / "run0", 2)
    os.makedirs(tmp_path / "run1")
    from_stdin = subprocess.Popen([sys.executable, "-", str(tmp_path / "run1"), "2"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
    outs = [from_stdin.communicate(SCRIPT.replace('if __name__ == "__main__":', "if True:"),
                                   timeout=240), from_file.communicate(timeout=240)]
    for p, (out, err) in zip((from_stdin, from_file), outs):
        assert p.returncode == 0, err[-2000:]
        assert "RESULT [2.0, 2.0]" in out


def test_ctrl_c_stops_every_rank(tmp_path):
    folder = tmp_path / "sleep"
    proc = run_script(tmp_path, folder, 3)
    wait_for_pids(folder, 3)  # every rank runs fn: the interrupt stops running ranks
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert_all_gone(folder, 3)


def test_ranks_leave_when_the_launching_process_is_killed(tmp_path):
    folder = tmp_path / "sleep"
    proc = run_script(tmp_path, folder, 2)
    wait_for_pids(folder, 2)
    proc.kill()  # SIGKILL: no finally blocks run in the parent
    proc.wait()
    assert_all_gone(folder, 2, within=10)


KERNEL = """
import sys, time
import labkit
def sleeper(ctx):
    time.sleep(120)
if __name__ == "__main__":
    print(time.monotonic(), flush=True)   # the launch starts now, on a cold forkserver
    try:
        labkit.launch(sleeper, 2, timeout_s=300)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    time.sleep(600)                       # a Jupyter kernel lives on after a cell's interrupt
"""


def forkserver_children(kernel_pid):
    """Live processes forked by the kernel's forkserver: its ranks (and no-op warm-ups)."""
    def parent_and_state(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[0]
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                table[int(name)] = parent_and_state(name)
            except (OSError, IndexError):
                pass
    servers = set()
    for pid, (parent, _) in table.items():
        if parent == kernel_pid:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"forkserver" in f.read():
                        servers.add(pid)
            except OSError:
                pass
    return [pid for pid, (parent, state) in table.items() if parent in servers and state != "Z"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_interrupt_during_a_cold_start_leaves_no_rank_behind(tmp_path):
    """Ctrl-C at several moments of a cold start (forkserver importing torch, ranks starting,
    ranks running), in processes that live on as a Jupyter kernel does: 20 s later no rank is
    alive, and no traceback came out of the forkserver. Odd ones get the signal as a terminal
    or a Jupyter interrupt sends it (the whole process group), even ones alone."""
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    delays = (0.0, 1.0, 2.5, 4.0, 6.0)
    kernels = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                stderr=open(tmp_path / f"err{i}", "w"), text=True,
                                start_new_session=True, preexec_fn=sigint_as_a_terminal_gives_it)
               for i in range(len(delays))]
    signalled = [None] * len(delays)

    def interrupt(i):
        started = float(kernels[i].stdout.readline())
        time.sleep(max(0.0, started + delays[i] - time.monotonic()))
        if i % 2:
            os.killpg(kernels[i].pid, signal.SIGINT)
        else:
            kernels[i].send_signal(signal.SIGINT)
        signalled[i] = time.monotonic()
    try:
        interrupters = [threading.Thread(target=interrupt, args=(i,)) for i in range(len(delays))]
        for t in interrupters:
            t.start()
        for t in interrupters:
            t.join(timeout=300)
        assert all(signalled), "a kernel never started its launch"
        time.sleep(max(0.0, max(signalled) + 20 - time.monotonic()))
        left = {delays[i]: forkserver_children(k.pid) for i, k in enumerate(kernels)}
        assert not any(left.values()), f"ranks alive 20 s after the interrupt: {left}"
        for i, k in enumerate(kernels):
            assert k.poll() is None, "the kernel must live on"
            assert k.stdout.readline().strip() == "interrupted"
            err = (tmp_path / f"err{i}").read_text()
            assert "Traceback" not in err, f"interrupt at {delays[i]} s:\n{err[-3000:]}"
    finally:
        for k in kernels:
            try:
                os.killpg(k.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            k.wait()


def test_the_same_script_runs_under_torchrun_and_exits_cleanly(tmp_path):
    """Five torchrun runs, all exit 0: a group labkit made is torn down before interpreter
    shutdown (left to it, a worker aborts after its result in about half the runs)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    runs = []
    for i in range(5):
        folder = tmp_path / f"torchrun{i}"
        os.makedirs(folder)
        runs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(script), str(folder), "2"], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=ROOT))
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
        # every rank gets all results (the two ranks' prints may interleave)
        assert out.count("RESULT") == 2 and out.count("[2.0, 2.0]") == 2


def test_rank_limit_reads_available_memory_not_free_memory(tmp_path):
    """A machine whose page cache fills memory (MemFree 0.5 GB, MemAvailable 20 GB) holds 4
    ranks; the refusal names the limit that binds and its numbers."""
    from labkit.runtime.cpus import cpu_rank_limit
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          500000 kB\n"
                       "MemAvailable:   20000000 kB\nCached:         19000000 kB\n")
    limit, why = cpu_rank_limit(str(meminfo))
    assert limit >= 4
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          500000 kB\n"
                       "MemAvailable:    2100000 kB\n")
    limit, why = cpu_rank_limit(str(meminfo))
    assert limit == 5 and "2.2 GB available" in why and "400 MB per rank" in why


def _yields_its_rank(ctx):
    yield ctx.rank


async def _awaits(ctx):
    return ctx.rank


@pytest.mark.parametrize("fn, words", [
    (42, "fn must be a function taking ctx"),
    ("all_reduce", "fn must be a function taking ctx"),
    (_yields_its_rank, "fn is a generator function (_yields_its_rank)"),
    (_awaits, "fn is an async function (_awaits)"),
])
def test_an_fn_no_rank_could_call_is_refused_before_any_rank_starts(fn, words, monkeypatch):
    import labkit.runtime.launch as launch_module

    def no_ranks():
        raise AssertionError("a rank process was asked for")
    monkeypatch.setattr(launch_module, "mp_context", no_ranks)
    with pytest.raises(TypeError) as err:
        labkit.launch(fn, 2)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)
