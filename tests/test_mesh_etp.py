"""Expert tensor parallelism (parallel/expert_tp.py): ExpertParallel with each expert split over
a TP group equals one device (labkit's MoE layer with its router losses, a hand-written one with
its own expert plan and a frozen bias; with and without sequence parallelism); on the mesh
tp2 x ep2 x dp2 (x pp2) trains the MoE GPT as one device does, holds the planner's
stage_parameters and moves the planner's bytes on tp and ep (runs/miniature.py); a plan that
does not fit the experts is refused in one line."""
import pytest
import torch

import labkit
from labkit.parallel.mappings import gather_keep_slice
from labkit.runs import miniature as mini
from labkit.runtime.launch import launch
from test_moe import STEPS, assert_equal_to_single_device, batch, loss_of, make_layer, \
    optimizer_for

HAND_PLAN = {"0": "colwise", "2": "rowwise"}   # test_moe.HandMoE's nn.Sequential experts
COMBOS = [("labkit", 2, 0.75, "adamw"), ("labkit", 1, 4.0, "sgd"), ("frozen", 2, 0.75, "sgd")]


def expert_tensor_parallel(ctx, combos, sequence_parallel):
    """4 ranks: EP groups [0, 2] and [1, 3], TP groups [0, 1] and [2, 3]. Each EP rank takes
    its chunk of the batch; under SP each TP rank passes half of it and the loss is taken on
    the gathered output (gather_keep_slice: the loss is computed alike on both TP ranks)."""
    tp = ctx.split_groups([[0, 1], [2, 3]])
    ep = ctx.split_groups([[0, 2], [1, 3]])
    results = []
    for kind, k, cf, opt in combos:
        layer = labkit.ExpertParallel(make_layer(kind, k, cf), group=ep, tp_group=tp,
                                      sequence_parallel=sequence_parallel,
                                      expert_plan=None if kind == "labkit" else HAND_PLAN)
        optimizer = optimizer_for(layer.parameters(), opt)
        outs, dropped = [], 0
        for step in range(STEPS):
            x, y = (t.chunk(ep.size)[ep.rank] for t in batch(step))
            optimizer.zero_grad()
            out = layer(x.chunk(tp.size)[tp.rank] if sequence_parallel else x)
            if sequence_parallel:
                out = gather_keep_slice(out, tp, "loss input", dim=-2)
            loss_of(kind, layer, out, y).backward()
            for name, p in layer.named_parameters():   # the router: replicated over EP
                if ".experts." not in name and p.requires_grad:
                    ctx.comm.all_reduce(p.grad, op="avg", group=ep, tag="router grads")
            optimizer.step()
            outs.append(out.detach())
            dropped += layer.routing["dropped"]
        results.append(dict(outs=outs, params=layer.full_state_dict(), dropped=dropped,
                            shapes={n: tuple(p.shape) for n, p in layer.named_parameters()}))
    return results


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_expert_parallel_with_tensor_parallel_experts_equals_one_device(sequence_parallel):
    results = launch(expert_tensor_parallel, 4, COMBOS, sequence_parallel, timeout_s=300)
    # the TP peers compute the same outputs: one EP rank's chunk each
    assert_equal_to_single_device([results[0], results[2]], COMBOS)
    assert_equal_to_single_device([results[1], results[3]], COMBOS)
    shapes = results[0][0]["shapes"]   # labkit's expert: fc1 (2h, h) and fc2 (h, 2h) halved
    assert shapes["module.experts.0.fc1.weight"] == (16, 16)
    assert shapes["module.experts.0.fc2.weight"] == (16, 16)
    assert shapes["module.experts.0.fc2.bias"] == (16,)        # replicated, added once


def refusals(ctx):
    tp = ctx.split_groups([[0, 1]])
    said = []
    for kind, plan in (("hand", None), ("labkit", {"fc1": "vocab"})):
        try:
            labkit.ExpertParallel(make_layer(kind, 1, 1.0), tp_group=tp, expert_plan=plan)
        except ValueError as error:
            said.append(str(error))
    return said


def test_a_plan_that_does_not_fit_the_experts_is_one_line():
    said = launch(refusals, 2, timeout_s=120)[0]
    assert len(said) == 2 and all("\n" not in s for s in said), said
    assert "plan key 'fc1' matches no module of Sequential" in said[0]
    assert "colwise or rowwise" in said[1]


@pytest.mark.parametrize("fields", [dict(dp=2, tp=2, ep=2, pp=2),
                                    dict(dp=2, tp=2, ep=2, pp=2, sequence_parallel=True)],
                         ids=["dp x tp x ep x pp", "dp x tp+sp x ep x pp"])
def test_mesh_holds_and_moves_what_the_planner_says(fields):
    """8 ranks: equal to one device; params per rank the planner's stage_parameters (its
    experts / (ep tp)) + the derived replicated biases; tp and ep bytes its formulas'."""
    out = mini.miniature(fields)
    text = mini.format_rows(out)
    print(text)
    rep = out["report"]
    for name in ("loss", "params"):
        assert rep["agreement"][name]["ok"], rep["agreement"][name]["verdict"]
    rows = {r["what"]: r for r in out["rows"]}
    for what in ("params", "grads", "optimizer", "tp bytes", "pp bytes", "dp bytes",
                 "ep bytes"):
        assert rows[what]["verdict"] == "equal", text
    # the ep all-to-alls carry every token's rows on each TP rank: the planner's
    # ep_all_to_all_bytes of micro-batch x seq / cp tokens, not / tp (row "ep bytes" equal)
    assert rows["ep bytes"]["measured"] > 0 and rows["tp bytes"]["measured"] > 0
