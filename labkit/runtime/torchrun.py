"""`launch` under torchrun: this process is one of the ranks, torchrun made the others.

No parent watches the ranks here, so each rank keeps its own deadline and its own status: the
process group gets `timeout_s` (torch's default is 30 minutes), so a deadlocked collective
raises on every rank at the deadline; the rank then names the op it was in and, through
torchrun's store, the ops the other ranks were in, and says which mismatch that is. A rank
dies with torchrun (Linux: PR_SET_PDEATHSIG), so none outlives its shutdown.
"""
import atexit
import ctypes
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import deaths
from .context import STATUS_WIDTH, Context
from .deaths import LaunchError

PR_SET_PDEATHSIG = 1             # <sys/prctl.h>
NO_TIMEOUT = timedelta(days=7)
GATHER_STATUS_S = 3              # how long a failing rank waits to hear the others' ops


def run(fn, world_size, args, kwargs, backend, cluster, seed, timeout_s):
    """`fn(ctx, *args, **kwargs)` on this rank; every rank gets the list of all results."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size not in (None, size):
        raise ValueError(f"launch(world_size={world_size}) but torchrun started {size} ranks")
    die_with_parent()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        limit = NO_TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s)
        dist.init_process_group(backend, timeout=limit)
        # A group left for interpreter shutdown to tear down may abort the process ("terminate
        # called without an active exception") after its work is done: labkit made it, so
        # labkit destroys it, before that.
        atexit.register(_destroy_default_group)
    board = bytearray(STATUS_WIDTH * size)   # this rank's own status board
    ctx = Context(rank, size, backend, cluster=cluster, status=board, seed=seed)
    torch.manual_seed(seed)
    try:
        result = fn(ctx, *args, **kwargs)
    except Exception as error:   # noqa: BLE001 - a collective's failure is named, then raised
        count, text, last = deaths.read_board(board, rank, STATUS_WIDTH)
        if not (text or "Timed out" in str(error)):
            raise
        raise LaunchError(_failure_message(rank, size, count, text or last, error,
                                           timeout_s)) from error
    results = [None] * size
    dist.all_gather_object(results, result)
    return results


def _failure_message(rank, size, count, op, error, timeout_s):
    """This rank's op, the others' (shared through torchrun's store), the mismatch if named."""
    states = _share_states(rank, size, count, op)
    timed_out = "Timed out" in str(error) or "timed out" in str(error)
    head = (f"rank {rank} timed out after {timeout_s:g}s" if timed_out and timeout_s
            else f"rank {rank} failed ({type(error).__name__}: {str(error).splitlines()[0]})")
    lines = [f"{head}; where the ranks wait:"]
    for r in range(size):
        state = states.get(r)
        lines.append(f"  rank {r}: {state[1] or 'not in a collective' if state else 'unknown'}")
    named = deaths.mismatch({r: s for r, s in states.items() if s[1]}, {})
    if named:
        lines.append(named)
    elif timed_out:
        lines.append("A deadlock if the other ranks never call the collective this rank waits "
                     "in (every rank must call the same collectives in the same order); "
                     "otherwise pass a larger timeout_s to launch.")
    return "\n".join(lines)


def _share_states(rank, size, count, op):
    """{rank: (count, op)}: this rank's, and those the other ranks put in the store in time."""
    states = {rank: (count, op)}
    deadline = time.monotonic() + GATHER_STATUS_S
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"labkit/failed/{rank}", f"{count}|{op}")
        for r in range(size):
            if r == rank:
                continue
            key = f"labkit/failed/{r}"
            left = max(0.05, deadline - time.monotonic())
            store.wait([key], timedelta(seconds=left))
            n, _, text = store.get(key).decode(errors="replace").partition("|")
            states[r] = (int(n) if n.isdigit() else None, text)
    except Exception:   # noqa: BLE001 - best effort: a rank that never answered stays unknown
        pass
    return states


def die_with_parent():
    """Linux: the kernel kills this process when torchrun (its parent) dies."""
    if sys.platform.startswith("linux") and "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        except (OSError, AttributeError):
            pass


def _destroy_default_group():
    if dist.is_initialized():
        dist.destroy_process_group()
