"""fully_shard swapped for torch's: one script body, run on 2 gloo ranks once with
`from labkit.parallel import fully_shard, MixedPrecisionPolicy` and once with
`from torch.distributed.fsdp import ...` (same DeviceMesh, same arguments): bottom-up on a small
model whose dims do not divide by 2 (a 7-row weight: 4 + 3 rows; a 1-row parameter: rank 1
holds none), 3 steps of Adam. Equal bit for bit: each rank's losses and its rows of every
parameter, in fp32 and with bf16 compute (fp32 reduce). The labkit run also equals one device
(labkit.numerics' rule) and holds 1/N of each parameter (torch.chunk's rows, padded) between
steps, its full parameters freed. One spawn runs everything (the machine is small)."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from labkit import numerics
from spawn_helpers import spawn

STEPS, BATCH, WIDTH = 3, 8, 7
BF16_COMPUTE = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        return h + torch.tanh(self.mix(self.norm(h)))


class Stack(nn.Module):
    """Layers sharded one by one; the root keeps the input and output layers and a gain."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(6, WIDTH), nn.Linear(WIDTH, 3)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.gain = nn.Parameter(torch.full((1,), 1.5))   # one row: rank 1 holds none

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h) * self.gain


def batch(step):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def script(rank, world_size, which, policy):
    """The learner's script: only the import differs."""
    if which == "torch":
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
    else:
        from labkit.parallel import fully_shard, MixedPrecisionPolicy
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = Stack()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy))
    fully_shard(model, mesh=mesh,
                mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, share = [], BATCH // world_size
    for step in range(STEPS):
        x, y = (t[rank * share:(rank + 1) * share] for t in batch(step))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    # torch's parameters are DTensors (their rows: .to_local()); labkit's are the rows
    rows = {n: getattr(p, "to_local", lambda p=p: p)().detach().clone()
            for n, p in model.named_parameters()}
    return dict(losses=torch.stack(losses), rows=rows, model=model,
                cls=(type(model).__name__, isinstance(model, Stack)))


def _labkit_extras(out):
    """What labkit's run holds between steps, and its full parameters gathered."""
    from labkit.parallel.fsdp2 import full_tensor
    model = out.pop("model")
    shards = {n: p._labkit_fsdp2 for n, p in model.named_parameters()}
    out["full"] = {n: full_tensor(p) for n, p in model.named_parameters()}
    out["held"] = {n: (tuple(s.sharded.shape), tuple(s.padded.shape),
                       s.full.untyped_storage().nbytes()) for n, s in shards.items()}
    return out


class Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.0))


def _refusals():
    from labkit.parallel import fully_shard
    said = []
    for build in (lambda: fully_shard(fully_shard(nn.Linear(2, 2))),
                  lambda: fully_shard(Scalar()),
                  lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 2)))):
        try:
            build()
        except ValueError as e:
            said.append(str(e))
    return said


def _everything(rank, world_size):
    import labkit
    out = {}
    for name, policy in (("fp32", {}), ("bf16", BF16_COMPUTE)):
        for which in ("labkit", "torch"):
            labkit.context().comm.reset()
            run = script(rank, world_size, which, policy)
            out[which, name] = _labkit_extras(run) if which == "labkit" else \
                dict(run, model=None)
            out[which, name]["comm"] = {(row["op"], row["tag"]): row["calls"] for row in
                                        labkit.context().comm.summary(by=("op", "tag"))}
    out["refusals"] = _refusals()
    return out


def reference(dtype):
    torch.manual_seed(0)
    model = Stack().to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = numerics.cast(batch(step), dtype)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.detach() for n, p in model.named_parameters()}


_RESULTS = {}


def results():
    if not _RESULTS:
        _RESULTS["ranks"] = spawn(_everything, 2)
    return _RESULTS["ranks"]


def test_labkit_equals_torch_bit_for_bit():
    for rank, out in enumerate(results()):
        for policy in ("fp32", "bf16"):
            mine, theirs = out["labkit", policy], out["torch", policy]
            assert torch.equal(mine["losses"], theirs["losses"]), (rank, policy)
            assert mine["rows"].keys() == theirs["rows"].keys()
            for name, rows in mine["rows"].items():
                assert torch.equal(rows, theirs["rows"][name]), (rank, policy, name)


def test_keeps_the_class_as_torch_does():
    out = results()[0]
    assert out["labkit", "fp32"]["cls"] == out["torch", "fp32"]["cls"] == ("FSDPStack", True)


def test_labkit_equals_one_device():
    exact_losses, exact = reference(torch.float64)
    single_losses, single = reference(torch.float32)
    ranks = results()
    losses = (ranks[0]["labkit", "fp32"]["losses"] + ranks[1]["labkit", "fp32"]["losses"]) / 2
    assert numerics.compare_loss(losses, single_losses, exact_losses)
    for out in ranks:
        agreement = numerics.compare(out["labkit", "fp32"]["full"], single, exact)
        assert agreement, agreement


def test_each_rank_holds_its_rows_between_steps():
    """torch.chunk's rows: c = ceil(d0 / 2) per rank, the last rank's padded to c; the full
    parameters' storage freed after the step."""
    torch.manual_seed(0)
    shapes = {n: tuple(p.shape) for n, p in Stack().named_parameters()}
    for rank, out in enumerate(results()):
        held = out["labkit", "fp32"]["held"]
        assert held.keys() == shapes.keys()
        for name, shape in shapes.items():
            rows = torch.empty(shape).chunk(2)
            mine = tuple(rows[rank].shape) if rank < len(rows) else (0,) + shape[1:]
            chunk = -(-shape[0] // 2)
            assert held[name] == (mine, (chunk,) + shape[1:], 0), name


def test_collectives_are_logged():
    """Per step: each layer gathered before its forward and again before its backward, the
    root once (it keeps its parameters from forward to backward); one reduce-scatter each.
    torch's own run goes past labkit's log."""
    out = results()[0]
    assert out["labkit", "fp32"]["comm"] == {
        ("all_gather", "params Block"): 2 * 2 * STEPS, ("all_gather", "params Stack"): STEPS,
        ("reduce_scatter", "grads Block"): 2 * STEPS, ("reduce_scatter", "grads Stack"): STEPS}
    assert out["torch", "fp32"]["comm"] == {}


def test_refusals_are_one_line():
    said = results()[0]["refusals"]
    assert [s.split(":")[0] for s in said] == [
        "fully_shard applied twice to Linear", "fully_shard", "fully_shard"]
    assert "0-dim parameter in Scalar" in said[1] and "1-D mesh, got 2-D" in said[2]
    assert all("\n" not in s for s in said)
