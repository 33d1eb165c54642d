"""A named mesh of process groups: the world laid out as pp x dp x cp x tp (TP innermost).

Rank r sits at coordinates (pp, dp, cp, tp) with r = ((pp * DP + dp) * CP + cp) * TP + tp, so
with 8 GPUs per node a TP group of up to 8 stays inside one node (NVLink), and the groups that
move the most bytes per step use the fastest link (Megatron-LM's ordering, Narayanan et al.
2021, arXiv 2104.04473). `order=` lays the dimensions out otherwise, e.g. to show TP across
nodes being slow. Expert parallelism splits the data-parallel dimension: `ep` ranks with the
same (pp, cp, tp) and neighbouring dp hold different experts; `ep_dp` are the replicas of the
same experts within one cp index (their gradients are averaged; with cp > 1 over the cp
ranks too, parallel/mesh_dims.ep_dp_cp_group).

    mesh = Mesh(dp=2, tp=2, pp=2)       # or ctx.mesh(...); every rank builds it, same order
    mesh["tp"]          # this rank's TP group (a Group; pass it as group= to a block)
    mesh.coords         # {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    mesh.table()        # one row per world rank: its coordinates
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

DIMS = ("pp", "dp", "cp", "tp")   # outermost to innermost
GROUP_ORDER = ("tp", "pp", "ep", "dp", "ep_dp", "cp")   # a set of ranks is named by the first


class Mesh:
    find_context = None   # set by runtime.context: how a Mesh built without ctx finds it

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 order: Sequence[str] = DIMS, ctx=None) -> None:   # ctx: a runtime Context
        ctx = ctx if ctx is not None else Mesh.find_context()
        self.ctx = ctx
        self.sizes = dict(dp=dp, tp=tp, pp=pp, cp=cp)
        for name, size in dict(self.sizes, ep=ep).items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh: {name} must be a positive integer, got {size!r}")
        if sorted(order) != sorted(DIMS):
            raise ValueError(f"mesh: order must name each of {DIMS} once, got {order}")
        total = math.prod(self.sizes.values())
        if total != ctx.world_size:
            shape = " x ".join(f"{k}={v}" for k, v in self.sizes.items() if v > 1) or "1"
            raise ValueError(f"mesh {shape} needs {total} ranks, the world has {ctx.world_size}")
        if dp % ep:
            raise ValueError(f"mesh: ep={ep} must divide dp={dp} (experts are spread over "
                             "data-parallel ranks)")
        self.ep = ep
        self.order = tuple(order)
        self._coords = [self._coordinates(r) for r in range(ctx.world_size)]
        self.coords = self._coords[ctx.rank]
        self.groups = {}
        for name in DIMS:   # every rank makes every group, in the same order
            self.groups[name] = ctx.split_groups(self._partition(name))
        self.groups["ep"] = ctx.split_groups(self._partition("dp", lambda c: c["dp"] // ep))
        self.groups["ep_dp"] = ctx.split_groups(self._partition("dp", lambda c: c["dp"] % ep))

    def _coordinates(self, rank):
        coords, rest = {}, rank
        for name in reversed(self.order):
            coords[name] = rest % self.sizes[name]
            rest //= self.sizes[name]
        return {name: coords[name] for name in DIMS}

    def _partition(self, varying, split=None):
        """Rank lists that agree on every dimension but `varying` (and on `split`, if given)."""
        groups = {}
        for rank, c in enumerate(self._coords):
            fixed = tuple(c[d] for d in DIMS if d != varying)
            groups.setdefault((fixed, split(c) if split else 0), []).append(rank)
        return list(groups.values())

    def __getitem__(self, name: str):   # -> the dimension's Group (runtime.context)
        if name not in self.groups:
            raise KeyError(f"mesh has groups {sorted(self.groups)}, not {name!r}")
        return self.groups[name]

    def rank_at(self, **coords: int) -> int:
        """The world rank at the given coordinates (unnamed dimensions: 0)."""
        want = {d: coords.get(d, 0) for d in DIMS}
        return self._coords.index(want)

    def table(self) -> list[dict[str, int]]:
        """One dict per world rank: rank, its coordinates, and its ep index."""
        return [dict(rank=r, **c, ep=c["dp"] % self.ep) for r, c in enumerate(self._coords)]

    def label_comm(self, rows: list[dict]) -> list[dict]:
        """`rows` of a comm summary by group, each given the mesh dimension it ran on ("dim"):
        the DP averages say which group they use in their tag; else the group's ranks do (a set
        of ranks that is several dimensions' group is named by the first in GROUP_ORDER)."""
        names = {}
        for dim in GROUP_ORDER:
            if dim in self.groups:
                names.setdefault(self[dim].name, dim)
        for row in rows:
            tag_dim = row["tag"].split(" ")[0]
            row["dim"] = tag_dim if tag_dim in ("dp", "ep_dp") else names.get(row["group"], "other")
        return rows

    def __repr__(self):
        shape = ", ".join(f"{d}={self.sizes[d]}" for d in self.order)
        return f"Mesh({shape}, ep={self.ep})"


def comm_by_dim(rows_per_rank: Iterable[list[dict]]) -> list[dict]:
    """Payload bytes and ring-model bytes per rank, summed over every rank, by mesh dimension
    (dp / tp / pp / ep / ep_dp) and op, from each rank's `Mesh.label_comm` rows: a list of rows."""
    rows = {}
    for rank_rows in rows_per_rank:
        for row in rank_rows:
            key = (row["dim"], row["op"])
            out = rows.setdefault(key, dict(dim=row["dim"], op=row["op"], calls=0, bytes=0,
                                            wire_bytes=0.0, modelled_s=0.0))
            out["calls"] += row["calls"]
            out["bytes"] += row["bytes"]
            out["wire_bytes"] += row["wire_bytes_per_rank"]
            out["modelled_s"] += row["modelled_s"]
    return sorted(rows.values(), key=lambda row: (GROUP_ORDER.index(row["dim"])
                                                  if row["dim"] in GROUP_ORDER else 99,
                                                  row["op"]))


def layouts(world_size: int, dims: Sequence[str] = ("dp", "tp", "pp")
            ) -> Iterator[dict[str, int]]:
    """Every way to write `world_size` as a product over `dims` (for explorers and planners)."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for combo in itertools.product(divisors, repeat=len(dims)):
        if math.prod(combo) == world_size:
            yield dict(zip(dims, combo))
