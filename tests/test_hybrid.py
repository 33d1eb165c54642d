"""DP x TP x PP (x EP) composed from the blocks (labkit.parallel.hybrid): the 8-rank mesh
trains the tiny GPT as one device does, with and without ZeRO-1 and sequence parallelism, and
its MoE variant with expert parallelism; bad layouts are refused in one line."""
import pytest

from labkit import cli
from labkit.runs import hybrid, reference


def equals_one_device(rep):
    """The report's verdict (labkit.numerics): parameters and loss against the float64 run
    within a few times the float32 single-device run's own error. Adam too: where a true
    gradient is 0 (the key bias) Adam turns rounding noise into steps, in the float32
    reference as well, so its own error carries them."""
    for name in ("params", "loss"):
        assert rep["agreement"][name]["ok"], (name, rep["agreement"][name]["verdict"])
    return True


def run(optimizer="sgd", **layout):
    cfg = reference.RunConfig(optimizer=optimizer)
    return hybrid.report(cfg=cfg, **dict(dict(dp=2, tp=2, pp=2), **layout))


def dims(report):
    return {(row["dim"], row["op"]) for row in report["comm_by_dim"]}


def test_dp_tp_pp_with_zero1_and_sequence_parallel_equals_one_device():
    rep = run("sgd", zero=1, sequence_parallel=True)
    assert rep["world_size"] == 8
    assert equals_one_device(rep)
    got = dims(rep)
    # TP with SP gathers and scatters along the sequence; PP sends; ZeRO-1 broadcasts owners'
    assert {("tp", "all_gather"), ("tp", "reduce_scatter"), ("pp", "send"), ("pp", "recv"),
            ("dp", "all_reduce"), ("dp", "broadcast")} <= got
    # TP innermost: ranks 0,1 share a TP group, 0 and 4 are the two pipeline stages
    table = {row["rank"]: row for row in rep["mesh_table"]}
    assert table[1]["tp"] == 1 and table[1]["pp"] == 0 and table[4]["pp"] == 1


def test_adam_default_layout_equals_one_device():
    rep = run("adam")
    assert equals_one_device(rep)
    # the planner's bytes for the same tiny shape and layout against the worst measured rank
    # (5%: it gives replicated biases and the final norm to every stage alike)
    for category in ("params", "grads", "optimizer", "activations"):
        worst = max(m[category] for m in rep["memory"].values())
        assert rep["predicted_memory"][category] == pytest.approx(worst, rel=0.05), category


def test_moe_variant_with_expert_parallelism_equals_one_device():
    rep = run("sgd", experts=4, ep=2, top_k=2)
    assert equals_one_device(rep)
    assert ("ep", "all_to_all") in dims(rep)
    assert any(k.endswith("experts.3.fc1.weight") for k in rep["params"])


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "TP degree 3 does not divide heads=4"),
    (["--pp", "4", "--tp", "1", "--dp", "1", "--schedule", "interleaved"],
     "8 pipeline stages need at least 6 GPT layers"),
    (["--dp", "3", "--tp", "1", "--pp", "1"], "does not split into dp=3"),
    (["--ep", "2"], "--ep needs a mixture of experts"),
    (["--experts", "4", "--ep", "4"], "must divide --experts 4 and --dp 2"),
    (["--world-size", "4"], "dp x tp x pp = 8"),
])
def test_bad_layouts_are_one_line(capsys, argv, message):
    assert cli.main(["run", "hybrid", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_layout_exercise_says_what_is_wrong():
    from functools import partial

    from labkit.exercises.hybrid import check_layout
    check_layout = partial(check_layout, gpus=64, global_batch=256)   # the lesson's 64 H100s
    assert not check_layout("tp=8", verbose=False)
    no_fit = check_layout(dict(dp=64, tp=1, pp=1, zero_stage=0), verbose=False)
    assert no_fit.problem == "does not fit" and "GB per GPU" in no_fit.message
    slow = check_layout(dict(dp=1, tp=64, pp=1), verbose=False)
    assert slow.problem == "too slow" and "TP communication" in slow.message
    assert check_layout(dict(dp=3, tp=8, pp=1), verbose=False).problem == "illegal"
    good = check_layout(dict(dp=4, tp=4, pp=4), verbose=False)
    assert good.ok and "fits" in good.message
