"""Every death explained (labkit/runtime/deaths.py): the op each rank was in, the likely cause,
the rank's own stderr, mismatches by name, and a warning when memory nears the limit."""
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import labkit
from labkit.runtime import deaths
from labkit.runtime.launch import LaunchError


@pytest.fixture(scope="module", autouse=True)
def warm_forkserver():
    labkit.launch(all_reduce_once, 2)


def all_reduce_once(ctx):
    ctx.comm.all_reduce(torch.ones(4))
    return ctx.rank


def all_reduce_or_broadcast(ctx):
    t = torch.ones(4)
    if ctx.rank == 0:
        ctx.comm.all_reduce(t)
    else:
        ctx.comm.broadcast(t, src=0)
    return ctx.rank


def one_collective_more_on_rank_1(ctx):
    ctx.comm.all_reduce(torch.ones(4))
    if ctx.rank == 1:
        ctx.comm.all_reduce(torch.ones(4))
    return ctx.rank


def killed_on_rank_1(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.comm.all_reduce(torch.ones(4))
    return ctx.rank


def killed_on_rank_1_while_rank_0_waits(ctx):
    # the ranks start together (the process group's set-up waits for both); rank 0 enters
    # all_reduce at once while rank 1 waits a second before it dies, so "rank 0 was in:
    # all_reduce" is what happened, not a race with rank 0's start
    if ctx.rank == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.comm.all_reduce(torch.ones(4))
    return ctx.rank


def test_all_reduce_against_broadcast_is_named_with_gloos_own_words():
    with pytest.raises(LaunchError) as err:
        labkit.launch(all_reduce_or_broadcast, 2, timeout_s=60)
    message = str(err.value)
    # gloo aborts the rank that receives data of the wrong size (signal 6), or both hang
    assert "Mismatched collectives: rank 0 in all_reduce; rank 1 in broadcast" in message
    if "died without a result" in message:
        assert "SIGABRT" in message and "stderr ended with" in message
        assert "collective mismatch" in message   # gloo's message, from the rank's stderr


def test_one_collective_more_on_one_rank_is_named():
    with pytest.raises(LaunchError) as err:
        labkit.launch(one_collective_more_on_rank_1, 2, timeout_s=60)
    message = str(err.value)
    assert "Rank 1 makes one collective more than the others" in message
    assert "collective #2 (all_reduce)" in message and "finished after 1 collective" in message


def test_signal_9_with_memory_near_the_limit_says_out_of_memory(monkeypatch):
    class NearlyFull(deaths.MemoryWatch):
        def sample(self, pids):
            self.lowest, self.limit = 0.1e9, 1e9
    monkeypatch.setattr(deaths, "MemoryWatch", NearlyFull)
    with pytest.raises(LaunchError) as err:
        labkit.launch(killed_on_rank_1_while_rank_0_waits, 2, timeout_s=60)
    message = str(err.value)
    assert message.startswith("rank 1 died without a result (signal 9, SIGKILL)")
    assert "it was not in a collective" in message and "rank 0 was in: all_reduce" in message
    assert "likely out of memory" in message and "0.1 GB" in message


def test_signal_9_with_memory_to_spare_says_killed_from_outside():
    with pytest.raises(LaunchError) as err:
        labkit.launch(killed_on_rank_1, 2, timeout_s=60)
    assert "killed from outside" in str(err.value)


def test_memory_near_the_limit_warns_once_with_the_ranks_use(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:     800000 kB\n")
    watch = deaths.MemoryWatch(str(meminfo))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch.sample([os.getpid()])
        watch.sample([os.getpid()])
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    assert re.search(r"1 ranks use \d+\.\d GB and only 0\.8 GB is left", str(caught[0].message))
    assert watch.was_low()
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert not deaths.MemoryWatch(str(meminfo)).was_low()


def test_a_rank_killed_by_a_signal_shows_its_stderr():
    def says_then_aborts(ctx):
        import sys
        if ctx.rank == 0:
            print("the last words of rank 0", file=sys.stderr, flush=True)
            os.abort()
        ctx.comm.barrier()
    with pytest.raises(LaunchError) as err:
        labkit.launch(says_then_aborts, 2, timeout_s=60)
    message = str(err.value)
    assert "rank 0 died without a result (signal 6, SIGABRT)" in message
    assert "the last words of rank 0" in message


def test_mismatch_reads_groups_sizes_and_finished_ranks():
    in_op = "{} (group [{}], {} bytes) tag"
    same = deaths.mismatch({0: (3, in_op.format("all_reduce", "0, 1", 16)),
                            1: (3, in_op.format("all_reduce", "0, 1", 32))}, {})
    assert same.startswith("Mismatched sizes") and "rank 1 with 32 bytes" in same
    # different ops in different groups are no mismatch (a hybrid's TP and DP groups)
    assert deaths.mismatch({0: (3, in_op.format("all_reduce", "0, 1", 16)),
                            2: (3, in_op.format("broadcast", "2, 3", 16))}, {}) is None
    # waiting for a rank that finished: named even when the counts differ by more than one
    left = deaths.mismatch({1: (7, in_op.format("all_reduce", "0, 1", 16))}, {0: 3})
    assert "a collective the others never make" in left
    assert deaths.mismatch({1: (7, in_op.format("all_reduce", "1, 3", 16))}, {0: 3}) is None


# ------------------------------------------------------------------------ under torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)
DEADLOCK = """
import os, sys, torch, labkit
def fn(ctx, folder):
    open(os.path.join(folder, f"pid{ctx.rank}"), "w").write(str(os.getpid()))
    ctx.comm.recv(torch.ones(4), src=1 - ctx.rank)   # each waits for the other
    return 1
if __name__ == "__main__":
    timeout = None if sys.argv[2] == "none" else float(sys.argv[2])
    print("RESULT", labkit.launch(fn, 2, sys.argv[1], timeout_s=timeout), flush=True)
"""


def torchrun(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, **popen)


def test_under_torchrun_timeout_s_ends_a_deadlock_naming_each_ranks_op(tmp_path):
    script = tmp_path / "deadlock.py"
    script.write_text(DEADLOCK)
    started = time.monotonic()
    run = torchrun(script, tmp_path, 10)
    out, err = run.communicate(timeout=300)
    assert run.returncode != 0 and "RESULT" not in out
    assert "rank 0 timed out after 10s" in err or "rank 1 timed out after 10s" in err, err
    assert "rank 0: recv from rank 1" in err and "rank 1: recv from rank 0" in err
    # 10 s of waiting; the rest is three interpreters importing torch, on a loaded machine
    assert time.monotonic() - started < 200


def test_no_worker_outlives_torchrun(tmp_path):
    script = tmp_path / "deadlock.py"
    script.write_text(DEADLOCK)
    run = torchrun(script, tmp_path, "none")
    try:
        deadline = time.monotonic() + 200
        while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and run.poll() is None, run.communicate()
            time.sleep(0.2)
        time.sleep(0.5)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    finally:
        run.kill()   # torchrun dies outright: it can stop no one
        run.communicate()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "workers outlived torchrun"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_cli_under_torchrun_prints_one_report():
    run = torchrun("-m", "labkit", "run", "dp", "--steps", "1")
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-2000:]
    assert out.count("dp on 2 rank(s)") == 1


# ------------------------------------------------------------------- a script without the guard

UNGUARDED = """
import os, sys, torch, labkit
def fn(ctx):
    open(os.path.join(sys.argv[1], f"rank{ctx.rank}"), "w").write("started")
    return ctx.rank
def main():
    print("RESULT", labkit.launch(fn, 2), flush=True)
{call}
"""


@pytest.mark.parametrize("call, ok", [("main()", False),
                                      ("if __name__ == '__main__':\n    main()", True)])
def test_a_script_without_the_main_guard_fails_at_once_saying_add_it(tmp_path, call, ok):
    script = tmp_path / "script.py"
    script.write_text(UNGUARDED.replace("{call}", call))
    for attempt in range(2):   # the same answer every time, not only the second
        out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                             text=True, timeout=200, env=ENV)
        if ok:
            assert out.returncode == 0 and "RESULT [0, 1]" in out.stdout, out.stderr
            continue
        assert out.returncode == 1 and "RESULT" not in out.stdout
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("RuntimeError: script.py, line 8: launch is called at the top")
        assert 'if __name__ == "__main__":' in last
        assert not list(tmp_path.glob("rank*")), "a rank started"


@pytest.fixture
def two_cpu_hogs():
    """Two busy processes, as a loaded laptop has: the death and the survivor's error race."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=10)


def test_a_rank_killed_by_a_signal_is_named_before_a_survivors_downstream_error(two_cpu_hogs):
    # rank 1 dies; rank 0's all_reduce then fails with gloo's "connection closed": the cause
    # (the death) must be what the launch says, every time
    for _ in range(3):
        with pytest.raises(LaunchError) as err:
            labkit.launch(killed_on_rank_1, 2, timeout_s=60)
        message = str(err.value)
        assert message.startswith("rank 1 died without a result (signal 9, SIGKILL)"), message
        assert "rank 0 raised" not in message
    assert all(hog.poll() is None for hog in two_cpu_hogs)   # the load was there throughout


def test_lost_peer_and_out_of_memory_read_torchs_own_words():
    assert deaths.lost_peer("RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection "
                            "closed by peer [127.0.0.1]:2345")
    assert not deaths.lost_peer("ValueError: rank two is broken on purpose")
    try:
        torch.empty(2 ** 60, dtype=torch.uint8)
    except RuntimeError as error:
        said = deaths.out_of_memory(str(error))
    assert said.startswith("ran out of memory: it asked for 1,152,921,504,606,846,976 bytes")
    assert deaths.out_of_memory("ValueError: no") is None


def test_a_rank_out_of_memory_is_one_line_with_the_bytes_it_asked_for():
    def asks_too_much(ctx):
        if ctx.rank == 0:
            torch.empty(2 ** 60, dtype=torch.uint8)
        ctx.comm.barrier()
    with pytest.raises(LaunchError) as err:
        labkit.launch(asks_too_much, 2, timeout_s=60)
    message = str(err.value)
    assert message.startswith("rank 0 ran out of memory: it asked for 1,152,921,504,606,846,976 "
                              "bytes (1.15e+06 TB)"), message
    assert "\n" not in message and "Traceback" not in message


STOPPED_LAUNCH = """
import os, signal, sys, time, torch, labkit
def fn(ctx, folder):
    if ctx.rank == 1:
        open(os.path.join(folder, "ready"), "w").close()
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.comm.all_reduce(torch.ones(4))
if __name__ == "__main__":
    try:
        labkit.launch(fn, 2, sys.argv[1], timeout_s=60)
    except labkit.LaunchError as error:
        print(str(error).splitlines()[0])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, a Linux scheduler")
def test_a_death_is_named_first_when_the_launch_wakes_to_both_at_once(tmp_path):
    # The worst case of a busy machine, made certain: the launching process sleeps (SIGSTOP)
    # while rank 1 dies and rank 0 sends back gloo's downstream error; it wakes to both.
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_LAUNCH)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.path.dirname(
                                os.path.dirname(labkit.__file__))))
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)
        (tmp_path / "go").touch()
        time.sleep(3)   # rank 1 dies; rank 0's all_reduce fails and it sends its error
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:   # never leave it stopped, or behind
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert out.startswith("rank 1 died without a result (signal 9, SIGKILL)"), (out, err)
