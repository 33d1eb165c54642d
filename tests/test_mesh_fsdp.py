"""ZeRO-3 on the mesh (labkit.parallel.hybrid, zero_stage=3): FullyShard after TP and PP, and
HSDP, each train the tiny GPT as one device does; memory per rank and the DP bytes per mesh
dimension against theory/hybrid.py; bad degrees refused in one line naming the argument."""
import json

import pytest

from labkit import cli
from labkit.parallel.hybrid import validate_dims
from labkit.runs import hybrid, reference
from mesh_helpers import dp_bytes_match_theory, equals_one_device, ops, states_match_theory


def run(optimizer="adam", **layout):
    return hybrid.report(cfg=reference.RunConfig(optimizer=optimizer), zero=3, **layout)


def test_fsdp_x_tp_with_sequence_parallel_from_the_cli_equals_one_device(capsys):
    argv = ["run", "hybrid", "--dp", "2", "--tp", "2", "--pp", "1", "--zero", "3",
            "--sequence-parallel", "--json"]
    assert cli.main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["world_size"] == 4 and rep["config"]["zero"] == 3
    assert equals_one_device(rep)
    # FullyShard's gathers and reduce-scatters run on dp_shard; no replicated DP all-reduce
    assert {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
            ("tp", "reduce_scatter")} <= ops(rep)
    assert not {d for d, _ in ops(rep)} & {"dp", "dp_replicate"}
    assert states_match_theory(rep) and dp_bytes_match_theory(rep)


def test_fsdp_x_pp_equals_one_device_and_shards_by_dp():
    rep = run(dp=2, tp=1, pp=2, microbatches=2)
    assert equals_one_device(rep)
    assert ("pp", "send") in ops(rep)
    # per micro-batch gathers: the measured bytes carry the factor m of the docstring
    assert dp_bytes_match_theory(rep)
    assert states_match_theory(rep, ("params", "grads", "optimizer", "activations"))


def test_hsdp_x_tp_shards_within_dp_shard_and_averages_across_replicas():
    rep = run(dp=4, tp=2, pp=1, dp_replicate=2, optimizer="sgd")
    assert rep["world_size"] == 8
    assert equals_one_device(rep)
    assert {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
            ("dp_replicate", "all_reduce")} <= ops(rep)
    assert all(row["measured"]["dp_replicate"] > 0 for row in rep["dp_comm_by_rank"])
    assert dp_bytes_match_theory(rep)
    # weights are split over dp_shard = 2, not over all 4 dp ranks
    assert states_match_theory(rep, ("params", "grads"))


def test_fsdp_x_tp_x_pp_equals_one_device():
    rep = run(dp=2, tp=2, pp=2, optimizer="sgd")
    assert equals_one_device(rep)
    assert {("tp", "all_reduce"), ("pp", "send"), ("dp_shard", "all_gather")} <= ops(rep)
    assert dp_bytes_match_theory(rep) and states_match_theory(rep, ("params", "grads"))


@pytest.mark.parametrize("argv, message", [
    (["--zero", "2"], "zero_stage=2 with pp=2 is not composed"),
    (["--zero", "3", "--dp-replicate", "3"], "dp_replicate=3 does not divide dp=2"),
    (["--dp-replicate", "2"], "dp_replicate=2 needs zero_stage=3"),
])
def test_bad_degrees_are_one_line(capsys, argv, message):
    assert cli.main(["run", "hybrid", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=0, tp=1, pp=1), "dp must be a positive integer, got 0"),
    (dict(dp=2, tp=2, pp=1, dp_replicate=True, zero_stage=3), "dp_replicate must be a"),
    (dict(dp=2, tp=2, pp=2, world_size=4), "world_size=4 but dp x tp x pp = 8"),
])
def test_validator_names_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        validate_dims(**kwargs)
