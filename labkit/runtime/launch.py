"""Start one process per rank, run `fn(ctx)` on each, hand back the results in rank order.

The parent owns a TCPStore on a port the kernel picked (port 0), so two launches never race for
a port. Each child gets `fn` serialised by value (cloudpickle: notebook cells work), joins the
process group through that store, and answers on its own pipe: ("ok", result) or ("error", tb).
The parent watches the pipes and the processes: the first error, death or timeout stops all.
"""
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.connection import wait as wait_for

from .context import Context, STATUS_WIDTH

DEFAULT_TIMEOUT_S = 120.0
BYTES_PER_CPU_RANK = 400e6  # a CPU rank (Python + torch + gloo) needs about this much memory


class LaunchError(RuntimeError):
    """A rank raised, died, or the run timed out; the message names the rank(s)."""


@dataclass
class _Child:
    rank: int
    process: object
    conn: object
    done: bool = False


def launch(fn, world_size, *args, backend=None, timeout_s=DEFAULT_TIMEOUT_S,
           cluster="8xH100-NVLink", seed=0, threads=None, **kwargs):
    """Run `fn(ctx, *args, **kwargs)` on `world_size` ranks and return the results by rank.

    backend: None picks NCCL when there are at least `world_size` GPUs, else gloo on CPU.
    cluster: the modelled machine the virtual clock runs on (a name from `labkit.theory`).
    Under torchrun (RANK and WORLD_SIZE in the environment) this process is one of the ranks:
    `fn` runs here and every rank gets the list of all results.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_under_torchrun(fn, world_size, args, kwargs, backend, cluster, seed)
    backend = check_launch_args(world_size, backend)
    _check_cluster(cluster, world_size)
    if threads is None:  # share the cores: oversubscribed ranks are much slower than idle ones
        threads = max(1, (os.cpu_count() or 1) // world_size)
    payload = cloudpickle.dumps((fn, args, kwargs))
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False, timeout=_td(timeout_s + 30))
    procs = _mp_context()
    status = procs.Array("c", STATUS_WIDTH * world_size, lock=False)
    progress = procs.Array("q", 2, lock=False)  # rank 0's (steps done, steps in all)
    children = []
    try:
        with _no_missing_main_file():
            _start_ranks(procs, children, world_size, backend, store.port, payload,
                         (status, progress), cluster, seed, threads, timeout_s)
        return _collect(children, status, progress, timeout_s)
    finally:
        _stop_all(children)
        del store


def _start_ranks(procs, children, world_size, backend, port, payload, boards, cluster, seed,
                 threads, timeout_s):
    for rank in range(world_size):
        parent_conn, child_conn = procs.Pipe(duplex=False)
        p = procs.Process(target=_worker, daemon=True,
                          args=(rank, world_size, backend, port, payload, child_conn, boards,
                                cluster, seed, threads, timeout_s, os.getpid()))
        p.start()
        child_conn.close()
        children.append(_Child(rank, p, parent_conn))


def check_launch_args(world_size, backend):
    """Refuse bad arguments before any process starts; return the backend to use."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        backend = "nccl" if gpus >= world_size else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and world_size > gpus:
        raise ValueError(f"NCCL needs one GPU per rank: world_size={world_size} but this machine "
                         f"has {gpus} GPU(s). Use backend='gloo' to simulate ranks on the CPU.")
    if backend == "gloo":
        limit = max_cpu_ranks()
        if world_size > limit:
            raise ValueError(
                f"world_size={world_size} is far more CPU ranks than this machine can hold "
                f"(at most {limit} here: {os.cpu_count()} cores, about "
                f"{BYTES_PER_CPU_RANK / 1e6:.0f} MB per rank). For larger clusters use the "
                f"modelled numbers in labkit.theory, or run under torchrun on real machines.")
    return backend


def _check_cluster(cluster, world_size):
    from ..theory import hardware
    modelled = hardware.cluster(cluster)
    if world_size > modelled.world_size:
        raise ValueError(f"the modelled cluster {modelled.name!r} has {modelled.world_size} GPUs "
                         f"but world_size={world_size}; pick a bigger one, e.g. "
                         f"'{-(-world_size // 8)}x8xH100-IB'")


def max_cpu_ranks():
    """The most simulated ranks worth starting here: bounded by memory and by cores."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 8e9
    return max(2, min(int(available // BYTES_PER_CPU_RANK), 8 * max(2, os.cpu_count() or 1)))


def _collect(children, status, progress, timeout_s):
    """Wait for every rank's answer; raise on the first error, death, or at the timeout.

    While waiting, show a progress bar if rank 0 reports steps (`ctx.progress(done, total)`).
    """
    bar_box = [None]  # the tqdm bar, made once rank 0 says how many steps there are
    try:
        return _wait_for_results(children, status, progress, timeout_s, bar_box)
    finally:
        if bar_box[0] is not None:
            bar_box[0].close()


def _wait_for_results(children, status, progress, timeout_s, bar_box):
    results = [None] * len(children)
    deadline = time.monotonic() + timeout_s
    pending = {c.conn: c for c in children}
    sentinels = {c.process.sentinel: c for c in children}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LaunchError(_timeout_message(children, status, timeout_s))
        ready = wait_for(list(pending) + [s for s, c in sentinels.items() if not c.done],
                         timeout=min(left, 0.2))
        _show_progress(progress, bar_box)
        for obj in ready:
            if obj in pending:
                child = pending.pop(obj)
                try:
                    kind, body = obj.recv()
                except EOFError:
                    raise LaunchError(_death_message(child)) from None
                if kind == "error":
                    raise LaunchError(f"rank {child.rank} raised:\n{body}")
                results[child.rank] = cloudpickle.loads(body)
                child.done = True
            elif obj in sentinels:
                child = sentinels[obj]
                if not child.done and child.conn in pending and not child.conn.poll():
                    raise LaunchError(_death_message(child))
    return results


def _show_progress(progress, bar_box):
    done, total = progress[0], progress[1]
    if total <= 0:
        return
    if bar_box[0] is None:
        from tqdm.auto import tqdm
        bar_box[0] = tqdm(total=total, desc="steps (rank 0)", leave=False)
    bar_box[0].update(done - bar_box[0].n)


def _death_message(child):
    child.process.join(timeout=1)
    code = child.process.exitcode
    why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return f"rank {child.rank} died without a result ({why})"


def _timeout_message(children, status, timeout_s):
    lines = [f"timed out after {timeout_s:g}s; ranks still running and where they wait:"]
    for c in children:
        if c.done:
            continue
        where = _read_status(status, c.rank) or "running (not in a collective)"
        lines.append(f"  rank {c.rank}: {where}")
    lines.append("Ranks that wait in different collectives (or in one the others never call) "
                 "deadlock: every rank must call the same collectives in the same order.")
    return "\n".join(lines)


def _read_status(status, rank):
    raw = bytes(status[rank * STATUS_WIDTH:(rank + 1) * STATUS_WIDTH])
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def _stop_all(children):
    """Terminate, then kill, whatever is still alive: no rank outlives the call."""
    for c in children:
        if c.process.is_alive():
            c.process.terminate()
    deadline = time.monotonic() + 3
    for c in children:
        c.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if c.process.is_alive():
            c.process.kill()
            c.process.join(timeout=2)
        c.conn.close()


def _die_with_parent(parent_pid):
    """Leave at once if the launching process goes away (e.g. a killed Jupyter kernel)."""
    def watch():
        while True:
            time.sleep(0.5)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _worker(rank, world_size, backend, port, payload, conn, boards, cluster, seed, threads,
            timeout_s, parent_pid):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops us all
    _die_with_parent(parent_pid)
    torch.set_num_threads(threads)
    ctx = None
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=_td(timeout_s + 30))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=_td(timeout_s + 30))
        ctx = Context(rank, world_size, backend, cluster=cluster, status=boards[0],
                      progress=boards[1], seed=seed)
        torch.manual_seed(seed)  # same seed everywhere: every replica starts identical
        result = fn(ctx, *args, **kwargs)
        body = cloudpickle.dumps(result)
        conn.send(("ok", body))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        os._exit(1)
    # Known on torch 2.13/gloo: FSDP/DTensor runs may abort at interpreter shutdown after all
    # work is done. The result is handed back, so leave without running the shutdown path.
    try:
        conn.close()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _run_under_torchrun(fn, world_size, args, kwargs, backend, cluster, seed):
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size not in (None, size):
        raise ValueError(f"launch(world_size={world_size}) but torchrun started {size} ranks")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    ctx = Context(rank, size, backend, cluster=cluster, status=None, seed=seed)
    torch.manual_seed(seed)
    result = fn(ctx, *args, **kwargs)
    results = [None] * size
    dist.all_gather_object(results, result)
    return results


def _td(seconds):
    from datetime import timedelta
    return timedelta(seconds=seconds)


def _mp_context():
    """A forkserver that has imported torch once: later ranks start by fork, in a fraction of
    a second, instead of each importing torch again (seconds per rank on a laptop)."""
    ctx = mp.get_context("forkserver")
    # torch._dynamo is imported lazily by the first optimizer a rank builds (~800 modules):
    # importing it once here saves every rank seconds on every launch.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.optim",
                                "cloudpickle", __name__])
    return ctx


@contextmanager
def _no_missing_main_file():
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
