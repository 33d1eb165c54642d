"""The mechanics the blocks share (labkit.parallel.flat), MasterWeights and the instruments'
reset: packing by offset, the two bucket rules, gradient averaging with and without unused
parameters, masters handed to ZeRO and gathered back whole."""
import pytest
import torch
import torch.nn as nn

import labkit
from labkit.parallel.flat import (FlatBuffer, all_gather_objects, average_gradients,
                                  bucket_params, unwrapped_name)
from labkit.parallel.mixed_precision import MasterWeights
from labkit.parallel.tensor_parallel import parallelize
from labkit.parallel.zero import ShardedOptimizer


def test_flat_buffer_packs_by_offset_pads_and_binds():
    a, b = torch.arange(6.).view(2, 3), torch.tensor([7., 8.])
    flat = FlatBuffer([a, b], pad_to=4)
    assert (flat.numel, flat.padded) == (8, 8)
    assert flat.data.tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    odd = FlatBuffer([b, torch.ones(1)], pad_to=4)   # 3 elements -> 4, the padding zero
    assert odd.data.tolist() == [7, 8, 1, 0] and odd.part(1, 2).tolist() == [1, 0]
    pieces = odd.part_views(1, 2, odd.part(1, 2))     # rank 1 holds none of b, all of ones
    assert [p.tolist() for p in pieces] == [[], [1.0]]
    assert [p.tolist() for p in flat.part_views(0, 2, flat.part(0, 2))] == [[0, 1, 2, 3], []]
    assert torch.equal(flat.view(a), a) and flat.view(b).shape == (2,)
    flat.bind()
    flat.data.mul_(2)                                 # the tensors are views of the buffer now
    assert a[1, 2].item() == 10 and b.tolist() == [14, 16]
    layout = FlatBuffer([torch.empty(2, 2, device="meta"), torch.empty(3, device="meta")])
    assert layout.data is None                        # a layout only: read another buffer
    assert [v.shape for v in layout.views(torch.arange(7.))] == [(2, 2), (3,)]
    assert layout.views(torch.arange(7.))[1].tolist() == [4, 5, 6]


def test_bucket_rules_ddp_may_exceed_the_cap_deepspeed_does_not():
    params = [torch.zeros(n) for n in (10, 10, 10, 10)]     # 40 bytes each
    sizes = lambda buckets: [len(b) for b in buckets]       # noqa: E731
    assert sizes(bucket_params(params, 50, may_exceed=True)) == [2, 2]    # closes at >= 50
    assert sizes(bucket_params(params, 50, may_exceed=False)) == [1, 1, 1, 1]
    assert sizes(bucket_params(params, 0)) == [1, 1, 1, 1]   # cap 0: one tensor each
    mixed = [torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(1)]
    assert sizes(bucket_params(mixed, 1e9)) == [1, 1, 1]     # a dtype change cuts


def test_unwrapped_name():
    assert unwrapped_name("blocks.0.mlp.module.router.weight") == "blocks.0.mlp.router.weight"
    assert unwrapped_name("head.weight") == "head.weight"


def _averaging(ctx):
    """Rank r has gradient r+1 on `shared`, only rank 1 has one on `once`, none on `never`."""
    shared, once, never = (nn.Parameter(torch.zeros(3)) for _ in range(3))
    shared.grad = torch.full((3,), float(ctx.rank + 1))
    if ctx.rank == 1:
        once.grad = torch.full((3,), 4.0)
    kept = shared.grad
    average_gradients([shared, once, never], skip_unused=True, tag="test")
    out = dict(shared=shared.grad.tolist(), same_tensor=shared.grad is kept,
               once=once.grad.tolist(), never=never.grad)
    zeros = nn.Parameter(torch.zeros(2))
    average_gradients([zeros], per_tensor=True)      # no gradient anywhere: zeros, one call
    out["zeros"] = zeros.grad.tolist()
    out["calls"] = {(r["op"], r["tag"]): r["calls"] for r in ctx.comm.summary(by=("op", "tag"))}
    out["objects"] = all_gather_objects({"rank": ctx.rank}, tag="objs")
    out["options"] = []
    for options in (dict(), dict(regather=False, gather_output=False)):
        net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 6))
        parallelize(net, {"0": "colwise", "1": "vocab"}, **options)
        out["options"].append([(m.regather, m.gather_output) for m in net])
    first_clock = ctx.clock
    ctx.reset_instruments("8xH100-NVLink")
    out["fresh"] = (ctx.comm.summary() == [] and ctx.clock is not first_clock
                    and ctx.clock.cluster.name == first_clock.cluster.name)
    return out


def test_average_gradients_on_two_ranks():
    for out in labkit.launch(_averaging, 2):
        assert out["shared"] == [1.5] * 3 and out["same_tensor"]   # updated in place
        assert out["once"] == [2.0] * 3      # a rank without one contributes zeros
        assert out["never"] is None          # no rank had one: stays None (skip_unused)
        assert out["zeros"] == [0.0, 0.0]
        assert out["calls"][("all_reduce", "test")] == 1
        assert out["calls"][("all_reduce", "grad average 0")] == 1
        assert out["objects"] == [{"rank": 0}, {"rank": 1}]
        assert out["fresh"]
        assert out["options"] == [[(True, False), (True, True)],     # the head gathers logits
                                  [(False, False), (False, False)]]  # as parallelize was told


def test_a_group_is_named_as_the_comm_log_names_it():
    assert labkit.Group((0, 1, 2, 3), None, 0).name == "0-3"
    assert labkit.Group((1, 3), None, 0).name == "1,3"


def test_master_weights_step_fp32_and_round_back():
    weight = nn.Parameter(torch.tensor([1.0, 2.0]).to(torch.bfloat16))
    opt = MasterWeights([weight], inner=torch.optim.SGD, lr=1e-3)
    opt.load_masters([torch.tensor([1.0001, 2.0])])   # finer than bf16 can hold
    weight.grad = torch.ones(2, dtype=torch.bfloat16)
    opt.step()
    assert opt.masters[0].dtype == torch.float32
    assert opt.masters[0].tolist() == pytest.approx([1.0001 - 1e-3, 2.0 - 1e-3], abs=1e-7)
    assert weight.dtype == torch.bfloat16 and weight.tolist() == [1.0, 2.0]  # rounded back
    with pytest.raises(ValueError, match="2 values for 1 masters"):
        opt.load_masters([torch.zeros(2), torch.zeros(2)])


def _masters_round_trip(ctx, stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))
    unrounded = {p: p.detach().clone() for p in model.parameters()}
    model.to(torch.bfloat16)
    opt = ShardedOptimizer(model.parameters(), MasterWeights, stage=stage, bucket_mb=1e-5,
                           inner=torch.optim.SGD, lr=0.1)
    opt.optim.load_masters(opt.local_part(unrounded))
    whole = opt.gather_full(opt.optim.masters)
    return max((whole[p] - unrounded[p]).abs().max().item() for p in model.parameters())


@pytest.mark.parametrize("stage", [1, 2])
def test_local_part_and_gather_full_give_the_unrounded_masters_back(stage):
    assert labkit.launch(_masters_round_trip, 2, stage) == [0.0, 0.0]
