"""Where the virtual clock's ranks post when they issued each op, and read their peers' posts.

A rank's modelled timeline depends on the others only through the issue times of the ops they
share (a collective starts when its last member issues it; a message leaves at its send). Each
rank posts its issue time of an op under the op's key (the same on every member: the group's
ranks and the op's number among that group's ops) and reads the members' posts when it waits
for the op. A run posts on a key-value store, beside the ops and never inside them; a replay
(`clock.replay`) posts in memory.
"""
import os
import struct
import tempfile
import uuid

import torch.distributed as dist


class NotPosted(LookupError):
    """A peer's issue time is not on a replay's board yet (its rank has not reached the op)."""


class StoreBoard:
    """Issue times on the run's key-value store (torch.distributed's default store), 8 bytes
    each under the op's key and the poster's rank."""

    def __init__(self, store, prefix):
        self.store, self.prefix = store, prefix

    def post(self, key, rank, seconds):
        self.store.set(f"{self.prefix}{key}/{rank}", struct.pack("<d", seconds))

    def read(self, key, ranks):
        raw = self.store.multi_get([f"{self.prefix}{key}/{r}" for r in ranks])
        return [struct.unpack("<d", bytes(value))[0] for value in raw]


_own_stores = {}   # a program's world process group -> the file store the posts go to instead


def run_store():
    """Where the posts go: the launch's file store (kept until every rank is done) or
    torchrun's (its agent's). In a program that made its process group itself, rank 0 hosts
    the default store and may leave while a peer still reads, so the posts go to a file store
    whose path the first rank to ask puts in the default store (compare_set: one winner)."""
    store = base = dist.distributed_c10d._get_default_store()
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.FileStore) or "TORCHELASTIC_RUN_ID" in os.environ:
        return store
    own = _own_stores.get(dist.group.WORLD)
    if own is None:
        mine = os.path.join(tempfile.gettempdir(), f"labkit-clock-{uuid.uuid4().hex}")
        path = store.compare_set("labkit-clock/file", "", mine)
        path = bytes(path).decode()
        own = _own_stores[dist.group.WORLD] = dist.FileStore(path, dist.get_world_size())
    return own


class DictBoard(dict):
    """A replay's board: the posts of every replayed rank, in memory."""

    def post(self, key, rank, seconds):
        self[key, rank] = seconds

    def read(self, key, ranks):
        missing = [r for r in ranks if (key, r) not in self]
        if missing:
            raise NotPosted(f"{key} not posted by rank {missing[0]} yet")
        return [self[key, r] for r in ranks]
