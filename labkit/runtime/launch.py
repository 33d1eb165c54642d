"""Start one process per rank, run `fn(ctx)` on each, hand back the results in rank order.

The ranks meet through a FileStore in a private temporary folder, not a TCPStore: c10d's TCP
store resolves every peer address back to a name (getnameinfo), and when the DNS answer is lost
that stalls a launch 5 s (about 1 launch in 20 here). Each child gets `fn` serialised by value
(cloudpickle: notebook cells work), joins the process group, and answers on its own pipe:
("ok", result) or ("error", tb). The parent watches the pipes and the processes: the first
error, death or timeout stops all.

No rank outlives its launch. Ranks are forked by multiprocessing's forkserver (processes.py),
warmed before any rank is asked for and deaf to the Ctrl-C sent to our process group. Every
rank watches an "alive" pipe whose only write end the launch holds: when the launch ends
(returns, raises, is interrupted, or its process dies, even as a zombie) the pipe reads
end-of-file and the rank leaves, also a rank the forkserver forks late for a launch that was
interrupted while asking for it.
"""
import math
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as wait_for
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from . import deaths, torchrun
from .deaths import LaunchError
from .context import Context, STATUS_WIDTH
from .cpus import cpu_rank_limit, max_cpu_ranks, usable_cpus
from .processes import (check_fn, check_main_guard, mp_context, new_store_folder,
                        no_missing_main_file, use_loopback_for_gloo, warm_forkserver)

DEFAULT_TIMEOUT_S = 120.0
PEER_LOSS_GRACE_S = 3.0  # how long a death may take to show once its sockets closed (busy CPUs)
NO_TIMEOUT = timedelta(days=7)  # what torch gets when timeout_s=None ("wait as long as it takes")

_inside_rank = False  # True in a rank process, and under torchrun while `fn` runs


@dataclass
class _Child:
    rank: int
    process: object
    conn: object
    stderr: object = None   # a deaths.StderrTail
    done: bool = False


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
           timeout_s: float | None = DEFAULT_TIMEOUT_S, cluster: str = "8xH100-NVLink",
           seed: int = 0, threads: int | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(ctx, *args, **kwargs)` on `world_size` ranks and return the results by rank.

    backend: None picks NCCL when there are at least `world_size` GPUs, else gloo on CPU.
    timeout_s: seconds the ranks may take once started (None: no limit); under torchrun, the
        longest any collective may wait.
    cluster: the modelled machine the virtual clock runs on (a name from `labkit.theory`).
    Under torchrun (RANK and WORLD_SIZE in the environment) this process is one of the ranks:
    `fn` runs here and every rank gets the list of all results.
    """
    if _inside_rank:
        raise RuntimeError("launch cannot be nested: this code already runs on a rank. Use "
                           "ctx (ctx.comm, ctx.new_group) inside fn instead of a second launch.")
    check_fn(fn)
    timeout_s = check_timeout(timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_under_torchrun(fn, world_size, args, kwargs, backend, cluster, seed,
                                   timeout_s)
    backend = check_launch_args(world_size, backend)
    _check_cluster(cluster, world_size)
    check_main_guard(sys._getframe(1))
    if threads is None:  # share the cores: oversubscribed ranks are much slower than idle ones
        threads = max(1, usable_cpus() // world_size)
    payload = cloudpickle.dumps((fn, args, kwargs))
    procs = mp_context()
    with no_missing_main_file():
        warm_forkserver(procs)
    status = procs.Array("c", STATUS_WIDTH * world_size, lock=False)
    progress = procs.Array("q", 2, lock=False)  # rank 0's (steps done, steps in all)
    children, store_dir, alive_w = [], None, None
    try:
        store_dir = new_store_folder()
        alive_r, alive_w = procs.Pipe(duplex=False)  # only this launch holds the write end
        with no_missing_main_file():
            for rank in range(world_size):
                conn, child_conn = procs.Pipe(duplex=False)
                err_r, err_w = procs.Pipe(duplex=False)  # the rank's stderr, passed on here
                p = procs.Process(target=_worker, daemon=True, args=(
                    rank, world_size, backend, os.path.join(store_dir, "store"), payload,
                    child_conn, alive_r, (status, progress), cluster, seed, threads, timeout_s,
                    err_w))
                p.start()
                child_conn.close()
                err_w.close()
                children.append(_Child(rank, p, conn, deaths.StderrTail(err_r)))
        return _collect(children, status, progress, timeout_s)
    finally:
        if alive_w is not None:
            alive_w.close()  # first: every rank, registered or still on its way, now leaves
            alive_r.close()
        try:
            _stop_all(children)
        finally:
            if store_dir is not None:
                shutil.rmtree(store_dir, ignore_errors=True)


def check_timeout(timeout_s):
    """None or +inf: no limit; otherwise a positive number of seconds."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or math.isnan(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, or None for no "
                         f"timeout; got {timeout_s!r}")
    return None if math.isinf(timeout_s) else float(timeout_s)


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
        limit, why = cpu_rank_limit()
        if world_size > limit:
            raise ValueError(
                f"world_size={world_size} is more CPU ranks than this machine can hold ({why}). "
                f"For larger clusters use the modelled numbers in labkit.theory, or run under "
                f"torchrun on real machines.")
    return backend


def _check_cluster(cluster, world_size):
    from ..theory import hardware
    modelled = hardware.cluster(cluster)
    if world_size > modelled.world_size:
        raise ValueError(f"the modelled cluster {modelled.name!r} has {modelled.world_size} GPUs "
                         f"but world_size={world_size}; pick a bigger one, e.g. "
                         f"'{-(-world_size // 8)}x8xH100-IB'")


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
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = {c.conn: c for c in children}
    sentinels = {c.process.sentinel: c for c in children}
    tails = {c.stderr.conn: c.stderr for c in children if c.stderr is not None}
    memory = deaths.MemoryWatch()
    while pending:
        left = 0.2 if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise LaunchError(_timeout_message(children, status, timeout_s))
        ready = wait_for(list(pending) + [s for s, c in sentinels.items() if not c.done]
                         + [conn for conn, tail in tails.items() if tail.open],
                         timeout=min(left, 0.2))
        _show_progress(progress, bar_box)
        memory.sample([c.process.pid for c in children if not c.done])
        for obj in ready:
            if obj in tails:
                tails[obj].read()
            elif obj in pending:
                child = pending.pop(obj)
                try:
                    kind, body = obj.recv()
                except EOFError:
                    raise LaunchError(_death_message(child, children, status, memory)) from None
                if kind == "error":
                    dead = deaths.killed_rank(children, child, body, PEER_LOSS_GRACE_S)
                    if dead is not None:   # the cause, not gloo's word for its consequence
                        raise LaunchError(_death_message(dead, children, status, memory))
                    raise LaunchError(_error_message(child, body, children, status))
                results[child.rank] = _unpickle_result(child.rank, body)
                child.done = True
            elif obj in sentinels:
                child = sentinels[obj]
                if not child.done and child.conn in pending and not child.conn.poll():
                    raise LaunchError(_death_message(child, children, status, memory))
    return results


def _unpickle_result(rank, body):
    try:
        return cloudpickle.loads(body)
    except Exception as error:  # noqa: BLE001 - any failure here is the result's, say whose
        raise LaunchError(
            f"rank {rank}'s result cannot be unpickled in the launching process "
            f"({type(error).__name__}: {error}). Return plain data (numbers, lists, dicts, "
            f"tensors) or objects of classes this process can import.") from None


def _show_progress(progress, bar_box):
    done, total = progress[0], progress[1]
    if total <= 0:
        return
    if bar_box[0] is None:
        from tqdm.auto import tqdm
        bar_box[0] = tqdm(total=total, desc="steps (rank 0)", leave=False)
    bar_box[0].update(done - bar_box[0].n)


def _death_message(child, children, status, memory):
    """Who died, what each rank was in, the likely cause and the end of the rank's stderr."""
    child.process.join(timeout=1)
    if child.stderr is not None:
        child.stderr.drain()
    _let_survivors_arrive(children, status, child)
    states, finished = _board(children, status, also=child)
    last = deaths.read_board(status, child.rank, STATUS_WIDTH)[2]
    return deaths.death_message(child.rank, child.process.exitcode, states, finished,
                                child.stderr, memory, last)


def _let_survivors_arrive(children, status, dead, seconds=1.0):
    """A rank that dies at once can be noticed before the others reach the collective they
    will wait in: give them up to `seconds` to get there, so the message can say where."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        states, _ = _board(children, status, also=dead)
        if all(text for rank, (_, text) in states.items() if rank != dead.rank):
            return
        time.sleep(0.02)


def _error_message(child, body, children, status):
    """A rank's traceback, then the mismatch the status board shows, if any (e.g. a rank that
    makes one collective more than the others gets "connection reset" once they have left)."""
    oom = deaths.out_of_memory(body)
    if oom:
        return f"rank {child.rank} {oom}"
    message = f"rank {child.rank} raised:\n{body}"
    states, finished = _board(children, status, also=child)
    named = deaths.mismatch(states, finished)
    return f"{message}\n{named}" if named else message


def _board(children, status, also=None):
    """({rank: (count, op)} of ranks still running (and `also`), {rank: count} of ranks that
    finished: handed back their result, or left with exit code 0)."""
    states, finished = {}, {}
    for c in children:
        count, text, _ = deaths.read_board(status, c.rank, STATUS_WIDTH)
        if c is not also and (c.done or c.process.exitcode == 0):
            finished[c.rank] = count
        else:
            states[c.rank] = (count, text)
    return states, finished


def _timeout_message(children, status, timeout_s):
    """Name what each unfinished rank does: a rank in a collective says which (its status)."""
    running = [c.rank for c in children if not c.done]
    finished = [c.rank for c in children if c.done]
    states, done = _board(children, status)
    where = {r: states[r][1] for r in running}
    named = deaths.mismatch({r: states[r] for r in running}, done)
    waiting = [r for r in running if where[r]]
    head = f"timed out after {timeout_s:g}s"
    if not waiting:
        return (f"{head}: still computing, no rank waits in a collective (ranks "
                f"{_ranks(running)} are busy in fn). The work needs more time than timeout_s: "
                f"pass a larger timeout_s, or timeout_s=None for no limit.")
    lines = [f"{head}; ranks still running and where they wait:"]
    for r in running:
        lines.append(f"  rank {r}: {where[r] or 'still computing (not in a collective)'}")
    if finished:
        lines.append(f"  ranks {_ranks(finished)}: finished")
    if named:
        lines.append(f"A deadlock. {named}")
    elif len(waiting) == len(running):
        lines.append("A deadlock: every rank still running waits in a collective that the "
                     "others never join. Every rank must call the same collectives in the "
                     "same order.")
    else:
        lines.append(f"A deadlock if ranks {_ranks([r for r in running if not where[r]])} never "
                     "call the collective the others wait in (every rank must call the same "
                     "collectives in the same order); otherwise pass a larger timeout_s.")
    return "\n".join(lines)


def _ranks(ranks):
    return ", ".join(map(str, ranks))


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
        if c.stderr is not None:
            c.stderr.close()


def _leave_when_launch_ends(alive):
    """Exit at once when the launch's "alive" pipe reads end-of-file: its only write end is the
    launch's, closed when the launch ends or its process dies (a zombie holds no descriptors)."""
    if alive.poll():  # the launch that asked for this rank is already over
        os._exit(0)

    def watch():
        wait_for([alive])
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="labkit-alive-watch").start()


def _worker(rank, world_size, backend, store_path, payload, conn, alive, boards, cluster, seed,
            threads, timeout_s, stderr):
    global _inside_rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops us all
    os.dup2(stderr.fileno(), 2)  # to the launch, which passes it on and keeps its end: gloo's
    stderr.close()               # abort message is written here and nowhere else
    _leave_when_launch_ends(alive)
    _inside_rank = True
    torch.set_num_threads(threads)
    limit = NO_TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s + 30)
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(limit)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:  # all ranks on this machine: gloo over the loopback unless the user chose
            use_loopback_for_gloo()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=limit)
        ctx = Context(rank, world_size, backend, cluster=cluster, status=boards[0],
                      progress=boards[1], seed=seed)
        torch.manual_seed(seed)  # same seed everywhere: every replica starts identical
        result = fn(ctx, *args, **kwargs)
        try:
            body = cloudpickle.dumps(result)
        except Exception as error:
            raise TypeError(f"the result of fn on rank {rank} cannot be pickled to send it "
                            f"back ({type(error).__name__}: {error}); return plain data") \
                from error
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


def _run_under_torchrun(fn, world_size, args, kwargs, backend, cluster, seed, timeout_s):
    """This process is one of torchrun's ranks (see torchrun.py): `fn` runs here."""
    global _inside_rank
    _inside_rank = True
    try:
        return torchrun.run(fn, world_size, args, kwargs, backend, cluster, seed, timeout_s)
    finally:
        _inside_rank = False
