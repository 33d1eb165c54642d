"""Swap the import (issue 40): one script body for pipelining, the device mesh and context
parallelism, run on 2 gloo ranks of a plain spawn program once with labkit's names and once
with torch's (torch.distributed.pipelining, torch.distributed.device_mesh,
torch.distributed.tensor.experimental), the same arguments.

Pipelining (GPipe and 1F1B, 2 stages, 4 micro-batches, SGD, 2 steps; interleaved 1F1B on 4
stages, zero bubble on 2, each stage given input_args): the arithmetic is the
same (a stage's forward, the same backward order; labkit scales the loss by 1/M before the
backward where torch divides the gradients by M after it, the same in float32 when M is a power
of 2), so losses, outputs and parameters are equal bit for bit. The mesh: the same shape,
coordinates and group members. torch's context_parallel shards its buffers on CPU but its
attention has no CPU path (aten._scaled_dot_product_flash_attention_for_cpu has no sharding
strategy in torch 2.13), so its shards are compared with labkit's (the same head-tail layout) and
labkit's loss and gradients with one device by labkit.numerics' rule.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit import numerics
from spawn_helpers import spawn

MICRO, STEPS, SEQ, WIDTH, HEADS = 4, 2, 8, 16, 2


def pipeline_script(api, schedule_name):
    """A learner's loop as torch's docs write it; `api` is the module the names come from."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    rank = dist.get_rank()
    part = model[:2] if rank == 0 else model[2:]
    stage = api.PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = getattr(api, schedule_name)(stage, MICRO, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
    losses, outputs = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        if rank == 0:
            assert schedule.step(x) is None
        else:
            mine = []
            outputs.append(schedule.step(target=y, losses=mine).detach().clone())
            losses.extend(float(loss) for loss in mine)
        optimizer.step()
    return dict(losses=losses, outputs=outputs,
                params={k: p.detach().clone() for k, p in part.named_parameters()})


def interleaved_script(api, schedule_name, virtual):
    """2 ranks, 2V stages of one Linear + Tanh each (stages r, r + 2, ...); every stage but
    the first is given its input (input_args, which labkit's zero-bubble executor needs)."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2 * virtual)]
    rank = dist.get_rank()
    stages = [api.PipelineStage(layers[s], s, 2 * virtual, torch.device("cpu"),
                                input_args=torch.empty(2, 8) if s else None)
              for s in range(rank, 2 * virtual, 2)]
    schedule = getattr(api, schedule_name)(stages, MICRO, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            mine = []
            schedule.step(target=y, losses=mine)
            losses.extend(float(loss) for loss in mine)
        optimizer.step()
    return dict(losses=losses, outputs=[],
                params={str(i): p.detach().clone() for i, p in
                        enumerate(p for s in stages for p in s.submod.parameters())})


def mesh_script(init_device_mesh):
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "cp"))
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    ranks = dist.get_process_group_ranks
    return dict(size=mesh.size(), shape=tuple(mesh.shape), ranks=mesh.mesh.tolist(),
                coordinate=list(mesh.get_coordinate()), rank=mesh.get_rank(),
                local=[mesh.get_local_rank(d) for d in ("dp", "cp")],
                sub=[(mesh[d].size(), mesh[d].get_local_rank(), ranks(mesh[d].get_group()))
                     for d in ("dp", "cp")],
                flat=(flat.size(), flat.get_local_rank(), ranks(flat.get_group())))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, WIDTH))


def cp_data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(2, SEQ, WIDTH, generator=g), torch.randn(2, SEQ, WIDTH, generator=g)


def cp_script(context_parallel, mesh, dtype=torch.float32):
    """The loss and gradients of Attention on this rank's shards (the whole batch when `mesh`
    is None: one device), and the shard it was given."""
    torch.manual_seed(0)
    model = Attention().to(dtype)
    x, y = (t.to(dtype) for t in cp_data())
    if mesh is None:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return dict(loss=loss.item(), grads={k: p.grad for k, p in model.named_parameters()})
    with context_parallel(mesh, buffers=[x, y], buffer_seq_dims=[1, 1]):
        shard = x.clone()
        loss = F.mse_loss(model(x), y)       # this rank's mean: the shards are equal in size
        loss.backward()
    whole = torch.equal(x, cp_data()[0])
    grads = {}
    for k, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[k] = p.grad / dist.get_world_size()
    total = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(total)
    return dict(loss=total.item() / dist.get_world_size(), grads=grads, shard=shard,
                restored=whole)


def torch_shard(mesh):
    """torch's context_parallel's shard of the same buffer (no attention call inside)."""
    from torch.distributed.tensor.experimental import context_parallel

    x = cp_data()[0]
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
        return x.clone()


def swap_body(rank, world_size):
    import torch.distributed.pipelining as torch_pp
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import labkit.parallel as labkit_pp
    from labkit.parallel import context_parallel   # torch's name, the function
    from labkit.runtime.mesh import init_device_mesh as labkit_mesh
    out = {}
    for name in ("ScheduleGPipe", "Schedule1F1B"):
        out[name] = {"labkit": pipeline_script(labkit_pp, name),
                     "torch": pipeline_script(torch_pp, name)}
    for name, virtual in (("ScheduleInterleaved1F1B", 2), ("ScheduleInterleavedZeroBubble", 1)):
        out[name] = {"labkit": interleaved_script(labkit_pp, name, virtual),
                     "torch": interleaved_script(torch_pp, name, virtual)}
    out["mesh"] = {"labkit": mesh_script(labkit_mesh), "torch": mesh_script(torch_mesh)}
    from labkit.runtime.mesh import Mesh
    as_torch = Mesh(dp=2).as_device_mesh()     # labkit's named mesh, seen as a DeviceMesh
    out["Mesh as DeviceMesh"] = (as_torch.mesh_dim_names, as_torch.shape,
                                 as_torch.get_local_rank("dp"), as_torch["tp"].size(),
                                 dist.get_process_group_ranks(as_torch["dp"].get_group()))
    theirs = torch_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    out["cp"] = {"labkit mesh": cp_script(context_parallel, labkit_mesh("cpu", (world_size,))),
                 "torch mesh": cp_script(context_parallel, theirs),
                 "torch shard": torch_shard(theirs)}
    try:
        cp_script(__import__("torch.distributed.tensor.experimental",
                             fromlist=["context_parallel"]).context_parallel, theirs)
        out["torch cp on cpu"] = "ran"
    except NotImplementedError as why:
        out["torch cp on cpu"] = str(why).splitlines()[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stage = labkit_pp.PipelineStage(nn.Linear(2, 2), rank, 2, dist.group.WORLD)
        on_mesh = labkit_pp.PipelineStage(nn.Linear(2, 2), rank, 2, "cpu", group=theirs)
        labkit_pp.PipelineSchedule(stage, 2, F.mse_loss, schedule="gpipe")
    out["old order"] = (on_mesh.group.ranks, [str(w.message) for w in caught
                                            if w.category is DeprecationWarning])
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(swap_body, 2)


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                                      "ScheduleInterleavedZeroBubble"])
def test_pipeline_equals_torch_bit_for_bit(ranks, schedule):
    for rank in ranks:
        ours, theirs = rank[schedule]["labkit"], rank[schedule]["torch"]
        assert ours["losses"] == theirs["losses"]
        assert len(ours["outputs"]) == len(theirs["outputs"])
        assert all(torch.equal(a, b) for a, b in zip(ours["outputs"], theirs["outputs"]))
        assert ours["params"].keys() == theirs["params"].keys()
        assert all(torch.equal(ours["params"][k], theirs["params"][k]) for k in ours["params"])
    assert len(ranks[1][schedule]["labkit"]["losses"]) == STEPS * MICRO
    if schedule in ("ScheduleGPipe", "Schedule1F1B"):
        assert ranks[1][schedule]["labkit"]["outputs"][0].shape == (8, 4)


def test_device_mesh_answers_as_torchs(ranks):
    for rank in ranks:
        assert rank["mesh"]["labkit"] == rank["mesh"]["torch"]
    assert ranks[1]["mesh"]["labkit"]["flat"] == (2, 1, [0, 1])
    for rank, answers in enumerate(r["Mesh as DeviceMesh"] for r in ranks):
        assert answers == (("pp", "dp", "cp", "tp"), (1, 2, 1, 1), rank, 1, [0, 1])


def test_context_parallel_shards_as_torch_and_equals_one_device(ranks):
    single = cp_script(None, None)
    exact = cp_script(None, None, torch.float64)
    for rank in ranks:
        assert "sharding strategy" in rank["torch cp on cpu"]   # torch's needs CUDA kernels
        assert torch.equal(rank["cp"]["labkit mesh"]["shard"], rank["cp"]["torch shard"])
        for run in (rank["cp"]["labkit mesh"], rank["cp"]["torch mesh"]):
            assert run["restored"] and run["shard"].shape == (2, SEQ // 2, WIDTH)
            assert numerics.compare_loss([run["loss"]], [single["loss"]], [exact["loss"]])
            agreement = numerics.compare(run["grads"], single["grads"], exact["grads"])
            assert agreement, str(agreement)
    # zigzag: rank 0 holds the first and last quarters of the sequence
    assert torch.equal(ranks[0]["cp"]["labkit mesh"]["shard"][:, 2:], cp_data()[0][:, 6:])


def test_old_pipeline_stage_order_runs_with_a_deprecation(ranks):
    for rank in ranks:
        group_ranks, messages = rank["old order"]   # group_ranks: a stage on torch's mesh
        assert group_ranks == (0, 1)
        assert any("PipelineStage(module, stage, num_stages, device" in m for m in messages)
        assert any("use ScheduleGPipe(stages, n_microbatches, loss_fn)" in m for m in messages)


def test_torch_names_in_labkit_parallel_are_the_callables():
    """`from labkit.parallel import context_parallel` (or fully_shard) is torch's function, in
    a fresh interpreter, before and after every module of labkit.parallel is imported (a
    submodule of that name would rebind the package attribute); the package pickles by name
    (a function `launch` sends may hold `import labkit.parallel as lp` in its globals). The
    `with context_parallel(mesh, buffers=..., buffer_seq_dims=...)` it gives runs in swap_body."""
    import subprocess
    import sys
    script = """
import importlib, pickle, pkgutil
import cloudpickle
from labkit.parallel import context_parallel, fully_shard
import labkit.parallel as lp
for info in pkgutil.iter_modules(lp.__path__):
    importlib.import_module(f"labkit.parallel.{info.name}")
from labkit.parallel import context_parallel as again
assert again is context_parallel is lp.context_parallel, lp.context_parallel
assert lp.fully_shard is fully_shard and callable(fully_shard)
assert callable(context_parallel)
assert context_parallel.__module__ == "labkit.parallel.context_parallelism"
assert pickle.loads(cloudpickle.dumps(lambda: lp.ScheduleGPipe))() is lp.ScheduleGPipe
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]
