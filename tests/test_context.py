"""labkit.context() outside launch, Mesh groups (TP innermost), sub-group collectives and p2p
with group ranks, comm tags and the aggregated log, ctx.step and ctx.off_the_record."""
import pytest
import torch

import labkit
from labkit.runtime.mesh import Mesh, layouts
from spawn_helpers import spawn


def mesh_and_subgroups(ctx):
    mesh = ctx.mesh(dp=2, tp=2)
    t = torch.tensor([float(ctx.rank)])
    tp_sum = ctx.comm.all_reduce(t.clone(), group=mesh["tp"], tag="tp").item()
    dp_sum = ctx.comm.all_reduce(t.clone(), group=mesh["dp"], tag="dp").item()
    odd = ctx.new_group([1, 3])   # every rank makes it; only 1 and 3 use it
    odd_got = None
    if odd is not None:           # p2p with group ranks: member 0 (rank 1) -> member 1 (rank 3)
        if odd.rank == 0:
            ctx.comm.send(torch.tensor([42.0]), 1, group=odd, tag="odd")
        else:
            odd_got = ctx.comm.recv(torch.zeros(1), 0, group=odd, tag="odd").item()
        src = ctx.comm.broadcast(torch.tensor([float(ctx.rank)]), src=1, group=odd).item()
    else:
        src = None
    with ctx.off_the_record():
        ctx.comm.all_reduce(torch.ones(1))
    for i in range(2):
        with ctx.step(i, 2):
            ctx.comm.all_reduce(torch.ones(8), tag="step")
    return dict(coords=mesh.coords, table=mesh.table(), tp=tp_sum, dp=dp_sum, odd=odd_got,
                src=src, summary=ctx.comm.summary(by=("op", "group", "tag")),
                steps=len(ctx.clock.step_times()), tp_ranks=mesh["tp"].ranks)


def test_mesh_groups_p2p_and_tags():
    results = labkit.launch(mesh_and_subgroups, 4)
    # TP innermost: ranks {0,1} and {2,3} are TP groups, {0,2} and {1,3} DP groups.
    assert [r["tp_ranks"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["tp"] for r in results] == [1, 1, 5, 5]
    assert [r["dp"] for r in results] == [2, 4, 2, 4]
    assert results[3]["odd"] == 42.0 and results[1]["odd"] is None
    assert results[1]["src"] == 3.0 and results[3]["src"] == 3.0  # member 1 of {1,3} is rank 3
    assert results[2]["coords"] == dict(pp=0, dp=1, cp=0, tp=0)
    rows = {(r["op"], r["group"], r["tag"]): r for r in results[0]["summary"]}
    assert rows[("all_reduce", "0,1", "tp")]["calls"] == 1
    assert rows[("all_reduce", "0-3", "step")]["calls"] == 2
    assert rows[("all_reduce", "0-3", "step")]["bytes"] == 2 * 8 * 4
    assert ("all_reduce", "0-3", "") not in rows            # off the record: not logged
    assert results[0]["steps"] == 2


def test_mesh_refuses_a_wrong_shape():
    def bad(ctx):
        return ctx.mesh(dp=3, tp=2)
    with pytest.raises(labkit.LaunchError, match="needs 6 ranks, the world has 4"):
        labkit.launch(bad, 4)


def test_mesh_order_puts_tp_outermost_when_asked():
    def layout(ctx):
        return Mesh(dp=2, tp=2, order=("tp", "pp", "dp", "cp"), ctx=ctx)["tp"].ranks
    assert labkit.launch(layout, 4)[0] == (0, 2)


def test_layouts_enumerate_every_factorisation():
    got = list(layouts(8))
    assert dict(dp=2, tp=2, pp=2) in got and dict(dp=8, tp=1, pp=1) in got
    assert len(got) == 10


def _in_spawned_rank(rank, world_size):
    state = torch.get_rng_state()
    ctx = labkit.context()           # made from the default group init_process_group set up
    assert torch.equal(state, torch.get_rng_state()), "context() changed the RNG state"
    t = ctx.comm.all_reduce(torch.tensor([rank + 1.0]), tag="spawned")
    return dict(rank=ctx.rank, world=ctx.world_size, sum=t.item(),
                calls=ctx.comm.summary()[0]["calls"], same=labkit.context() is ctx)


def test_context_outside_launch():
    results = spawn(_in_spawned_rank, 2)
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert all(r["same"] and r["calls"] == 1 and r["world"] == 2 for r in results)


def test_context_without_distributed_says_how():
    import labkit.runtime.context as c
    if c._current is None:
        with pytest.raises(RuntimeError, match="init_process_group"):
            labkit.context()
