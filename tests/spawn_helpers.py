"""Run a function on N ranks in a plain `mp.spawn` + `init_process_group` program: no labkit
launch, as a learner's own script would. The blocks' tests use it to show they need no launch."""
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # the clock's file store (runtime/clock_board.run_store) is removed by FileStore's own
    # clean-up at a normal exit; os._exit below skips it, so put it where spawn() tidies
    tempfile.tempdir = out_dir
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # torch 2.13 + gloo: a process may abort at interpreter shutdown ("terminate called without
    # an active exception") after all its work is done; its result is saved, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world_size, *args):
    """`fn(rank, world_size, *args)` on `world_size` spawned processes; results by rank.

    `fn` must be importable (a module-level function of a test module)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world_size, _free_port(), fn, args, out_dir), nprocs=world_size,
                 join=True)
        # our own files: results may hold labkit objects (numerics.Agreement), not only tensors
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)
                for r in range(world_size)]
