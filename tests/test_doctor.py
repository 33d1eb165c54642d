"""`python -m labkit doctor --launch`, the pre-workshop check; the loopback launch gives gloo;
where `make install` takes torch from."""
import os
import shutil
import socket
import subprocess
import sys

import pytest

from labkit.runtime.processes import loopback_interface, use_loopback_for_gloo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doctor_launch(**env):
    environ = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    return subprocess.run([sys.executable, "-m", "labkit", "doctor", "--launch"], cwd=ROOT,
                          env={**environ, **env}, capture_output=True, text=True, timeout=300)


def test_doctor_launch_says_ready_with_its_times_and_the_loopback():
    run = doctor_launch()
    ready = [line for line in run.stdout.splitlines() if line.startswith("ready: ")]
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(ready) == 1 and "fix:" not in run.stdout
    assert "all-reduced" in ready[0] and "PNG" in ready[0] and " s " in ready[0]
    assert f"over gloo on {loopback_interface()} " in ready[0]  # launch chose the loopback


def test_a_wrong_gloo_interface_gets_a_fix_line_not_a_traceback():
    run = doctor_launch(GLOO_SOCKET_IFNAME="nosuch0")
    assert run.returncode == 1
    fixes = [line for line in run.stdout.splitlines() if line.startswith("fix: ")]
    assert fixes and "GLOO_SOCKET_IFNAME=nosuch0" in fixes[0], run.stdout
    assert "ready:" not in run.stdout and "Traceback" not in run.stdout + run.stderr


def test_launch_keeps_the_users_gloo_interface_and_else_picks_the_loopback():
    own = {"GLOO_SOCKET_IFNAME": "en7"}
    use_loopback_for_gloo(own)
    assert own == {"GLOO_SOCKET_IFNAME": "en7"}
    chosen = {}
    use_loopback_for_gloo(chosen)
    names = [name for _, name in socket.if_nameindex()]
    assert chosen["GLOO_SOCKET_IFNAME"] in names
    if os.path.isdir("/sys/class/net"):  # Linux: the kernel marks it as the loopback
        with open(f"/sys/class/net/{chosen['GLOO_SOCKET_IFNAME']}/flags") as f:
            assert int(f.read(), 16) & 0x8


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_takes_torch_from_the_cpu_index_on_linux_without_a_gpu(tmp_path):
    """Where torch comes from, read off `make -n` (nothing runs): TORCH_INDEX=auto is the CPU
    index exactly on Linux without nvidia-smi."""
    def planned(choice):
        return subprocess.run(["make", "-n", "install", f"VENV={tmp_path}/venv",
                               f"TORCH_INDEX={choice}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
    cpu_index = "https://download.pytorch.org/whl/cpu"
    assert cpu_index in planned("cpu") and cpu_index not in planned("default")
    assert "https://example.org/simple" in planned("https://example.org/simple")
    no_gpu_linux = sys.platform.startswith("linux") and shutil.which("nvidia-smi") is None
    assert (cpu_index in planned("auto")) == no_gpu_linux
