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

torch's interface too (`DeviceMesh`, as torch.distributed.device_mesh has it, over the same
labkit groups): `init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`, `mesh["tp"]`
a 1-D mesh, `get_group()` (a torch ProcessGroup, which every labkit `group=` takes), `size()`,
`get_local_rank()`, `get_rank()`, `mesh["dp", "cp"]._flatten()`; `Mesh.as_device_mesh()` views
a labkit Mesh so. `group_of(mesh_or_group)` is what a block taking a mesh calls: labkit's
DeviceMesh and torch's own both answer `get_group()`.
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

    def as_device_mesh(self) -> DeviceMesh:
        """This mesh with torch's DeviceMesh interface (dims in `order`, the same groups)."""
        import torch

        shape = [self.sizes[d] for d in self.order]
        ranks = [0] * self.ctx.world_size
        for rank, c in enumerate(self._coords):
            index = 0
            for d in self.order:
                index = index * self.sizes[d] + c[d]
            ranks[index] = rank
        return DeviceMesh(self.ctx.device.type, torch.tensor(ranks).view(shape),
                          mesh_dim_names=self.order,
                          _groups=[self.groups[d] for d in self.order], _ctx=self.ctx)


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """torch's `init_device_mesh`: the world's ranks laid out row-major in `mesh_shape` (the
    last dimension innermost), a process group per dimension. Every rank calls it."""
    import torch

    ctx = Mesh.find_context()
    if device_type != ctx.device.type:
        raise ValueError(f"init_device_mesh: device_type {device_type!r}, but this rank runs "
                         f"on {ctx.device.type!r} ({ctx.backend})")
    shape = tuple(int(n) for n in mesh_shape)
    if math.prod(shape) != ctx.world_size:
        raise ValueError(f"init_device_mesh: a {shape} mesh needs {math.prod(shape)} ranks, "
                         f"the world has {ctx.world_size}")
    return DeviceMesh(device_type, torch.arange(ctx.world_size).view(shape),
                      mesh_dim_names=mesh_dim_names, _ctx=ctx)


class DeviceMesh:
    """torch.distributed's DeviceMesh interface over labkit's groups: `mesh` holds the global
    ranks (an int tensor), each dimension has this rank's Group. Sub-meshes (`mesh["tp"]`,
    `mesh["dp", "cp"]`) reuse their parent's groups; `_flatten()` makes one group (every
    rank calls it, as in torch)."""

    def __init__(self, device_type, mesh, *, mesh_dim_names=None, _groups=None, _ctx=None,
                 _root=None):
        import torch

        self._ctx = _ctx if _ctx is not None else Mesh.find_context()
        self.device_type = device_type
        self.mesh = torch.as_tensor(mesh, dtype=torch.int64)
        names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        if names is not None and (len(names) != self.mesh.dim() or len(set(names)) < len(names)):
            raise ValueError(f"DeviceMesh: mesh_dim_names {names} must name each of the "
                             f"{self.mesh.dim()} dimensions once")
        self.mesh_dim_names = names
        self._root = _root if _root is not None else self
        if _root is None:
            self._flattened = {}      # name -> 1-D DeviceMesh, made by _flatten
        self._coordinate = [int(i) for i in (self.mesh == self._ctx.rank).nonzero()[0]] \
            if (self.mesh == self._ctx.rank).any() else None
        if self._coordinate is None:
            raise ValueError(f"DeviceMesh: rank {self._ctx.rank} is not in {self.mesh.tolist()}")
        self._groups = list(_groups) if _groups is not None else [
            self._ctx.split_groups(self._partition(d)) for d in range(self.mesh.dim())]

    def _partition(self, dim):
        """Every line of ranks along `dim` (the others fixed): the groups of that dimension."""
        return self.mesh.movedim(dim, -1).reshape(-1, self.mesh.shape[dim]).tolist()

    def _dim(self, mesh_dim):
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"DeviceMesh has dims {self.mesh_dim_names}, not {mesh_dim!r}")
            return self.mesh_dim_names.index(mesh_dim)
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"DeviceMesh has {self.ndim} dimensions: name one "
                                 "(mesh_dim=) or take a 1-D mesh, mesh['tp']")
            return 0
        return int(mesh_dim)

    @property
    def ndim(self) -> int:
        return self.mesh.dim()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    def size(self, mesh_dim=None) -> int:
        return self.mesh.numel() if mesh_dim is None else self.mesh.shape[self._dim(mesh_dim)]

    def get_group(self, mesh_dim=None):
        """The dimension's torch ProcessGroup (labkit's blocks take it as `group=`)."""
        return self._groups[self._dim(mesh_dim)].pg

    def get_all_groups(self) -> list:
        return [g.pg for g in self._groups]

    def labkit_group(self, mesh_dim=None):
        """The dimension's labkit Group (runtime.context)."""
        return self._groups[self._dim(mesh_dim)]

    def get_local_rank(self, mesh_dim=None) -> int:
        return self._coordinate[self._dim(mesh_dim)]

    def get_rank(self) -> int:
        return self._ctx.rank

    def get_coordinate(self) -> list[int]:
        return list(self._coordinate)

    def __getitem__(self, names) -> DeviceMesh:
        names = (names,) if isinstance(names, str) else tuple(names)
        if len(names) == 1 and names[0] in self._root._flattened:
            return self._root._flattened[names[0]]
        dims = [self._dim(n) for n in names]
        here = list(self._coordinate)
        index = tuple(slice(None) if d in dims else here[d] for d in range(self.ndim))
        kept = sorted(dims)
        sub = self.mesh[index].permute([kept.index(d) for d in dims])
        return DeviceMesh(self.device_type, sub, mesh_dim_names=names,
                          _groups=[self._groups[d] for d in dims], _ctx=self._ctx,
                          _root=self._root)

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """One 1-D mesh over all of this mesh's ranks, with a group of its own (every rank of
        the root mesh calls it, in the same order); found again as root[mesh_dim_name]."""
        name = mesh_dim_name or "_".join(self.mesh_dim_names or ("flat",))
        if name in self._root._flattened:
            return self._root._flattened[name]
        root, mine = self._root, set(self.mesh.flatten().tolist())
        dims = [root.mesh_dim_names.index(n) for n in self.mesh_dim_names]
        rest = [d for d in range(root.ndim) if d not in dims]
        lines = root.mesh.permute(rest + dims).reshape(-1, self.mesh.numel()).tolist()
        group = self._ctx.split_groups(lines)
        assert set(group.ranks) == mine, (group.ranks, mine)
        flat = DeviceMesh(self.device_type, self.mesh.flatten(), mesh_dim_names=(name,),
                          _groups=[group], _ctx=self._ctx, _root=root)
        root._flattened[name] = flat
        return flat

    def __repr__(self):
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names or
                                                     range(self.ndim), self.shape))
        return f"DeviceMesh(({dims}), {self.device_type!r})"


def group_of(mesh_or_group, mesh_dim=None):
    """What a block's `group=` takes, from a mesh or a group: a DeviceMesh (labkit's or
    torch's own: its `get_group(mesh_dim)`), or a group as it is (None: the world)."""
    if hasattr(mesh_or_group, "get_group"):
        return mesh_or_group.get_group(mesh_dim)
    return mesh_or_group


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
