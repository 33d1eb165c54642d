"""How launch makes its rank processes, and where their store lives.

Ranks are forked by multiprocessing's forkserver, which has imported torch once (a fork takes a
fraction of a second; a fresh interpreter imports torch for seconds). The forkserver runs in a
process group of its own, so the Ctrl-C a terminal or a Jupyter interrupt sends to our group
never reaches it (or the ranks it forks) mid-import, and it is warmed with a no-op process
before any rank is asked for. Each launch's ranks meet through a FileStore in a folder of its
own, marked with who made it (boot, pid namespace, host, user, pid and the pid's start time),
so that a later launch removes the folders of launches killed outright, and only those: a
folder it cannot prove a gone labkit launch made (another container's, a user's) stays.
"""
import ast
import inspect
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from multiprocessing import forkserver, resource_tracker, util as mp_util

import torch.multiprocessing as mp

from . import atomic

STORE_PREFIX = "labkit-store-"
OWNER_FILE = "labkit-owner.json"   # in each store folder: who made it (process_identity)
IFF_LOOPBACK = 0x8  # <net/if.h>: the interface flag of the loopback
_warm_forkserver_pid = None  # the forkserver known to have finished its imports


def mp_context():
    """A forkserver that has imported torch once: later ranks start by fork, in a fraction of
    a second, instead of each importing torch again (seconds per rank on a laptop)."""
    ctx = mp.get_context("forkserver")
    # torch._dynamo is imported lazily by the first optimizer a rank builds (~800 modules):
    # importing it once here saves every rank seconds on every launch.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.optim",
                                "cloudpickle", "labkit.runtime.launch"])
    return ctx


def warm_forkserver(procs):
    """Start the forkserver in a process group of its own, then wait until it can fork.

    A terminal's Ctrl-C and a Jupyter interrupt signal the whole process group. In a group of
    its own, the forkserver (and every rank it forks) never sees them, also while it imports
    torch: no import traceback in the cell, no forkserver dead mid-import; the launch stops the
    ranks itself. It still ends with us: it leaves when its "alive" pipe from us closes.
    Waiting for a no-op process means that no rank is ever queued behind the forkserver's
    imports: an interrupt during them stops the launch before any rank was asked for.
    """
    global _warm_forkserver_pid
    resource_tracker.ensure_running()  # its own spawn, not the patched one below
    spawn = mp_util.spawnv_passfds
    mp_util.spawnv_passfds = _spawn_in_own_group
    try:
        forkserver.ensure_running()
    finally:
        mp_util.spawnv_passfds = spawn
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None and pid == _warm_forkserver_pid:
        return  # this forkserver forked before: its imports are done
    p = procs.Process(target=_no_op, daemon=True)
    p.start()
    p.join()
    _warm_forkserver_pid = pid


def _spawn_in_own_group(path, args, passfds):
    """multiprocessing.util.spawnv_passfds, in a new session (so a new process group)."""
    child = subprocess.Popen(args, executable=path, pass_fds=passfds, start_new_session=True)
    child.returncode = 0  # multiprocessing reaps it (os.waitpid), not subprocess
    return child.pid


def _no_op():
    pass


def check_fn(fn):
    """Refuse, before any rank starts, an `fn` no rank could call and hand back."""
    if not callable(fn):
        raise TypeError(f"fn must be a function taking ctx (fn(ctx, *args, **kwargs)), got "
                        f"{type(fn).__name__} {fn!r:.60}")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"fn is a generator function ({getattr(fn, '__name__', fn)}): its "
                        f"result would be a generator, which cannot be sent back from a rank; "
                        f"return a list (e.g. list(...)) instead of yielding")
    if inspect.iscoroutinefunction(fn):
        raise TypeError(f"fn is an async function ({getattr(fn, '__name__', fn)}): each rank "
                        f"calls fn plainly; make it a plain def")


def check_main_guard(launch_frame):
    """Refuse a launch from a script's top level that lacks `if __name__ == "__main__":`.

    Each new rank process imports the main script again (as multiprocessing does, to find the
    functions it may need), so an unguarded `launch(...)` would start ranks from inside ranks.
    Packages run with -m (`labkit.__main__`) and notebooks, stdin and -c are not re-imported.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if path is None or not os.path.isfile(path) or name.endswith("__main__"):
        return
    frame = launch_frame
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return
    if not any(_is_main_guard(node) and node.lineno <= frame.f_lineno <= node.end_lineno
               for node in tree.body):
        raise RuntimeError(
            f"{os.path.basename(path)}, line {frame.f_lineno}: launch is called at the top "
            f"level of the script; put it under `if __name__ == \"__main__\":` (every rank "
            f"imports the script again, and would launch again)")


def _is_main_guard(node):
    """`if __name__ == "__main__":` (either side of the ==)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    values = {s.value for s in sides if isinstance(s, ast.Constant)}
    return names == {"__name__"} and values == {"__main__"}


@contextmanager
def no_missing_main_file():
    """With `python - <<EOF` the main "file" is <stdin>, which a new process cannot re-import;
    hide it while ranks start (they get `fn` by value and need no main module)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def new_store_folder():
    """A private folder for one launch's FileStore, marked as ours (`mark_store_folder`),
    after removing those of launches that are gone (`made_by_a_gone_launch`)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(STORE_PREFIX) and made_by_a_gone_launch(path):
            shutil.rmtree(path, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")
    mark_store_folder(folder)
    return folder


def process_identity(pid=None):
    """Who a process is, beyond its pid (which the system reuses): the machine's boot, its
    pid namespace (a container's own), the host name, the user, the pid and the process's
    start time since boot. Parts the system does not tell (no /proc) are None."""
    pid = os.getpid() if pid is None else pid
    return dict(labkit_store=1, boot_id=_read_line("/proc/sys/kernel/random/boot_id"),
                pid_namespace=_namespace(), host=socket.gethostname(), uid=os.getuid(),
                pid=pid, start_time=_start_time(pid))


def mark_store_folder(folder, pid=None):
    """Write the owner marker (`process_identity`) into a store folder labkit made."""
    atomic.write_json(os.path.join(folder, OWNER_FILE), process_identity(pid))


def made_by_a_gone_launch(path):
    """True only when `path` is a real folder (not a link) of this user holding labkit's owner
    marker, written on this boot, in this pid namespace, on this host, by a process that is no
    longer running (its pid dead, or alive with another start time: reused). A folder without
    the marker, another container's, another user's or a live launch's is never touched."""
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        with open(os.path.join(path, OWNER_FILE), encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int) \
            or isinstance(owner["pid"], bool) or owner["pid"] < 1:
        return False
    here = process_identity()
    if any(owner.get(key) != here[key] for key in ("labkit_store", "boot_id", "pid_namespace",
                                                    "host", "uid")):
        return False
    if not _alive(owner["pid"]):
        return True
    started = _start_time(owner["pid"])   # alive: the same process, or its pid reused
    return started is not None and owner.get("start_time") is not None \
        and started != owner["start_time"]


def _read_line(path):
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() or None
    except (OSError, ValueError):
        return None


def _namespace():
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _start_time(pid):
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None.
    The name field may hold spaces and parentheses: the fields are counted after its last ')'."""
    line = _read_line(f"/proc/{pid}/stat")
    if line is None or ")" not in line:
        return None
    fields = line.rsplit(")", 1)[1].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def use_loopback_for_gloo(environ=os.environ):
    """A launch's ranks share one machine, so gloo talks over the loopback interface. Left to
    itself gloo takes the address the host name resolves to, which a laptop often lacks (macOS
    on a conference Wi-Fi). A GLOO_SOCKET_IFNAME the user set is kept."""
    if "GLOO_SOCKET_IFNAME" not in environ:
        name = loopback_interface()
        if name is not None:
            environ["GLOO_SOCKET_IFNAME"] = name


def loopback_interface(sys_net="/sys/class/net"):
    """The loopback's name as the system lists it (`lo` on Linux, `lo0` on macOS), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    for name in names:  # Linux: the kernel's flags say which interface is the loopback
        try:
            with open(os.path.join(sys_net, name, "flags")) as f:
                if int(f.read(), 16) & IFF_LOOPBACK:
                    return name
        except (OSError, ValueError):
            continue
    # macOS and BSDs have no /sys: their loopback is the one named lo<number>
    return next((name for name in names if re.fullmatch(r"lo\d*", name)), None)
