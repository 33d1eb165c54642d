"""Checks the mesh tests share (test_mesh_fsdp.py, test_mesh_cp.py): a hybrid run report
against one device (labkit.numerics), its memory and DP bytes against theory/hybrid.py."""
import pytest


def equals_one_device(rep):
    """labkit.numerics' verdict: loss and updated parameters against the float64 run."""
    for name in ("params", "loss"):
        assert rep["agreement"][name]["ok"], (name, rep["agreement"][name]["verdict"])
    return True


def ops(rep):
    return {(row["dim"], row["op"]) for row in rep["comm_by_dim"]}


def states_match_theory(rep, categories=("params", "grads", "optimizer"), rel=0.05):
    """The worst rank's bytes against the planner's for the layout with ZeRO-3's division by
    dp_shard (5%: the planner gives replicated biases and norms to every stage alike)."""
    for category in categories:
        worst = max(m[category] for m in rep["memory"].values())
        assert rep["predicted_memory"][category] == pytest.approx(worst, rel=rel), category
    return True


def dp_bytes_match_theory(rep):
    """Each rank's DP bytes on the wire (ring model, from its comm log) by dimension against
    fsdp_wire_bytes for its own stage (the padding to a multiple of dp_shard: < 1%)."""
    for row in rep["dp_comm_by_rank"]:
        for dim, predicted in row["predicted"].items():
            assert row["measured"][dim] == pytest.approx(predicted, rel=0.01, abs=1), (row, dim)
    return True
