"""ZeRO-2 on the mesh (labkit.parallel.hybrid, zero_stage=2): ShardedOptimizer(stage=2) over
the dp group with TP + SP trains the tiny GPT as one device does over 2 micro-batches, holds
1/dp of ZeRO-1's gradients, and reduce-scatters after every micro-batch's backward: its DP
bytes are the planner's per-micro-batch formula (plan_terms); pp > 1 and experts refused in
one line. (dp x tp x cp with ZeRO-2: tests/test_miniature.py.)"""
import pytest

from labkit import cli
from labkit.runs import hybrid, reference
from labkit.theory import plan_terms as terms
from labkit.theory.time import wire_bytes_per_rank
from mesh_helpers import equals_one_device, ops

DP, LAYOUT = 2, dict(dp=2, tp=2, pp=1, sequence_parallel=True)


@pytest.fixture(scope="module")
def runs():
    """{(zero, micro-batches): report} of dp2 x tp2 + SP."""
    return {(zero, m): hybrid.report(cfg=reference.RunConfig(), zero=zero, microbatches=m,
                                     **LAYOUT)
            for zero, m in ((1, 2), (2, 2), (2, 1))}


def test_zero2_x_tp_with_sequence_parallel_equals_one_device(runs):
    rep = runs[(2, 2)]
    assert rep["world_size"] == 4 and rep["config"]["zero"] == 2
    assert equals_one_device(rep)
    # the optimizer's reduce-scatter averages the gradients: no DP all-reduce beside it; SP's
    # replicated weights are still summed over TP (once per backward)
    assert {("dp", "reduce_scatter"), ("dp", "all_gather"), ("tp", "all_reduce")} <= ops(rep)
    assert ("dp", "all_reduce") not in ops(rep)
    assert ("dp", "all_reduce") in ops(runs[(1, 2)])


def test_zero2_holds_a_dp_th_of_zero1s_gradients(runs):
    for r, zero1 in runs[(1, 2)]["memory"].items():
        zero2 = runs[(2, 2)]["memory"][r]
        # the flat bucket is padded to a multiple of dp: at most dp - 1 fp32 values more
        assert 0 <= DP * zero2["grads"] - zero1["grads"] <= 4 * (DP - 1) * DP
        # both shard the optimizer state over dp (ZeRO-1 by whole tensors: near 1/dp)
        assert zero2["optimizer"] == pytest.approx(zero1["optimizer"], rel=0.05)


def dp_wire_bytes(rep, op):
    """Ring-model bytes per rank and step of the DP group's `op`, from the comm logs."""
    rows = [r["wire_bytes"] for r in rep["comm_by_dim"] if r["dim"] == "dp" and r["op"] == op]
    return sum(rows) / rep["world_size"] / rep["steps"]


def test_dp_bytes_are_the_planners_per_micro_batch_formula(runs):
    """One reduce-scatter of the rank's fp32 gradients per micro-batch, one all-gather of its
    updated shard per step (plan_terms.dp_traffic_bytes x grad_reductions_per_step)."""
    for m in (1, 2):
        rep = runs[(2, m)]
        # every rank's flat bucket (params are views of it) holds the same padded count
        held = {mem["params"] for mem in rep["memory"].values()}
        assert len(held) == 1
        params = held.pop() / 4
        pay = terms.dp_traffic_bytes(params, 2, DP, weight_bytes=4)
        reductions = terms.grad_reductions_per_step(2, m)
        assert reductions == m
        assert dp_wire_bytes(rep, "reduce_scatter") == pytest.approx(
            reductions * wire_bytes_per_rank("reduce_scatter", pay["reduce_scatter"], DP),
            rel=1e-12)
        assert dp_wire_bytes(rep, "all_gather") == pytest.approx(
            wire_bytes_per_rank("all_gather", pay["all_gather"], DP), rel=1e-12)
    # twice the micro-batches, twice the reduce-scatters; the all-gather stays one per step
    one, two = runs[(2, 1)], runs[(2, 2)]
    assert dp_wire_bytes(two, "reduce_scatter") == pytest.approx(
        2 * dp_wire_bytes(one, "reduce_scatter"), rel=1e-12)
    assert dp_wire_bytes(two, "all_gather") == pytest.approx(dp_wire_bytes(one, "all_gather"),
                                                             rel=1e-12)


@pytest.mark.parametrize("argv, message", [
    (["--zero", "2", "--pp", "2"], "zero_stage=2 with pp=2 is not composed"),
    (["--zero", "2", "--pp", "1", "--experts", "4", "--ep", "2"], "zero_stage=2 with experts"),
    (["--zero", "5"], "zero_stage must be 0, 1, 2 or 3, got 5"),
])
def test_bad_layouts_are_one_line(capsys, argv, message):
    assert cli.main(["run", "hybrid", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
