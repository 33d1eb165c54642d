"""ZeRO-3 with experts on the mesh (labkit.parallel.hybrid, zero_stage=3, ep > 1): FullyShard
shards each block over dp_shard (x cp) and its experts over their own replicas, dp_shard x cp
/ ep ranks (torchtitan's dp_shard_mod_ep); FSDP x EP x PP and HSDP x CP x EP train the tiny
MoE GPT as one device does; the bytes per mesh dimension and the model states per rank are
theory/hybrid's; the tolerance would catch experts averaged over the wrong ranks."""
import pytest

from labkit import cli, numerics
from labkit.parallel.mesh_dims import validate_dims
from labkit.runs import hybrid, reference
from mesh_helpers import dp_bytes_match_theory, equals_one_device, ops

MOE = dict(experts=4, top_k=2)


def run(optimizer="sgd", steps=3, **layout):
    cluster = "8xH100-NVLink"
    return hybrid.report(cfg=reference.RunConfig(optimizer=optimizer, steps=steps),
                         cluster=cluster, zero=3, **MOE, **layout)


def states_are_sharded_by_group(rep, optimizer="sgd"):
    """Each rank's weights and gradients (measured) against the formula: the dense ones over
    dp_shard x cp, its experts over dp_shard x cp / ep ranks, 4 bytes each (fp32), Adam's two
    states the same split (padding to a multiple of the group: < 1%)."""
    c = rep["config"]
    shard = c["dp"] // c["dp_replicate"] * c["cp"]
    for row in rep["dp_comm_by_rank"]:
        held = row["held"]
        expected = 4 * ((held["params"] - held["experts"]) / shard
                        + held["experts"] / (shard // c["ep"]))
        memory = rep["memory"][row["rank"]]
        assert memory["params"] == pytest.approx(expected, rel=0.01), (row["rank"], expected)
        assert memory["grads"] == pytest.approx(expected, rel=0.01), row["rank"]
        if optimizer == "adam":
            assert memory["optimizer"] == pytest.approx(2 * expected, rel=0.01), row["rank"]
    return True


def test_fsdp_x_ep_x_pp_on_8_ranks_equals_one_device():
    rep = run(optimizer="adam", dp=4, tp=1, pp=2, ep=2)
    assert rep["world_size"] == 8
    assert equals_one_device(rep)
    # the blocks' gathers and reduce-scatters on dp_shard, the experts' on their replicas
    assert {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"), ("ep_dp", "all_gather"),
            ("ep_dp", "reduce_scatter"), ("ep", "all_to_all"), ("pp", "send")} <= ops(rep)
    assert not {d for d, _ in ops(rep)} & {"dp", "dp_replicate", "other"}
    assert dp_bytes_match_theory(rep) and states_are_sharded_by_group(rep, "adam")
    assert all(row["measured"]["ep_dp"] > 0 for row in rep["dp_comm_by_rank"])


def test_hsdp_x_cp_x_ep_shards_experts_within_dp_shard_and_averages_across_replicas():
    rep = run(dp=4, tp=1, pp=1, cp=2, ep=2, dp_replicate=2)
    assert rep["world_size"] == 8
    assert equals_one_device(rep)
    assert {("cp", "send"), ("dp_shard", "reduce_scatter"), ("ep_dp", "reduce_scatter"),
            ("dp_replicate", "all_reduce")} <= ops(rep)
    # dp_shard x cp = 4 ranks; the experts' shard group dp_shard x cp / ep = 2 ranks; the
    # replicas average dense and expert shards together
    assert dp_bytes_match_theory(rep) and states_are_sharded_by_group(rep)


def test_experts_averaged_over_the_wrong_ranks_would_be_caught():
    """One SGD step, so the update is -lr x the gradient: had the experts' gradients been
    averaged over all dp x cp ranks (as sharding them with the blocks over dp_shard would)
    instead of their dp x cp / ep replicas, each expert's update would be 1/ep of the right
    one. That run's parameters, built from the float64 run, are outside the tolerance the
    mesh's run meets."""
    rep = run(dp=2, tp=1, pp=1, cp=2, ep=2, steps=1)
    assert equals_one_device(rep)
    cfg = hybrid.run_config(reference.RunConfig(optimizer="sgd", steps=1), **MOE)
    exact, single = reference.float64_reference(cfg), reference.train(cfg, track_memory=False)
    start = dict(reference.build_model(cfg).named_parameters())
    ep = rep["config"]["ep"]
    wrong = {k: start[k].double() + (v - start[k].double()) / ep if ".experts." in k else v
             for k, v in exact["params"].items()}
    assert any(".experts." in k for k in wrong)
    caught = numerics.compare(wrong, single["params"], exact["params"])
    mesh = rep["agreement"]["params"]
    print(f"params rms error: mesh {mesh['error']:.2e} (limit {mesh['limit']:.2e}); "
          f"experts averaged over dp x cp {caught.error:.2e} (limit {caught.limit:.2e})")
    assert not caught and caught.error > 5 * mesh["limit"]


def test_hsdp_with_experts_needs_whole_ep_groups_in_dp_shard(capsys):
    argv = ["run", "hybrid", "--dp", "4", "--tp", "1", "--pp", "1", "--zero", "3",
            "--dp-replicate", "4", "--experts", "4", "--ep", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "dp_replicate=4 leaves dp_shard=1 ranks, not a multiple of ep=2" in err
    assert "Traceback" not in err and err.strip().count("\n") == 0
    with pytest.raises(ValueError, match="dp_replicate=2 leaves dp_shard=2 ranks, not a "
                                         "multiple of ep=4"):
        validate_dims(dp=4, tp=1, pp=1, ep=4, dp_replicate=2, zero_stage=3, experts=8)
