"""Context parallelism on the mesh (labkit.parallel.hybrid with cp > 1): CP x DP, CP x TP (+SP),
CP x PP, HSDP x CP and FSDP x TP x PP x CP each train the tiny GPT as one device does; the
bytes on the `cp` dimension equal the ring formula of theory/context_parallel.py; activations
per rank fall as the planner's cp term says; bad degrees refused in one line naming the argument."""
import json

import pytest

from labkit import cli, models
from labkit.parallel.mesh_dims import validate_dims
from labkit.runs import hybrid, reference
from labkit.theory import context_parallel as theory_cp, plan_terms as terms
from labkit.theory.catalog import ModelShape
from labkit.theory.time import wire_bytes_per_rank
from mesh_helpers import dp_bytes_match_theory, equals_one_device, ops, states_match_theory

CFG = reference.RunConfig()
SHAPE = models.GPTConfig(**CFG.model_kwargs)


def run(optimizer="adam", **layout):
    cluster = "2x8xH100-IB" if layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"] > 8 \
        else "8xH100-NVLink"
    return hybrid.report(cfg=reference.RunConfig(optimizer=optimizer), cluster=cluster,
                         **layout)


def cp_bytes_match_ring(rep):
    """The `cp` bytes sent (comm_by_dim, summed over ranks) against the ring formula: per
    attention call (forward + backward) comm_bytes_per_rank for this rank's micro-batch and
    its h / tp heads in fp32, for each layer, micro-batch, step and each of the dp x tp x cp
    ranks running that layer."""
    c = rep["config"]
    micro_batch = CFG.global_batch // (c["dp"] * c["microbatches"])
    per_call = theory_cp.comm_bytes_per_rank(
        micro_batch, SHAPE.heads // c["tp"], SHAPE.seq, SHAPE.hidden // SHAPE.heads, c["cp"],
        dtype_bytes=4, grad_bytes=4)["total"]
    expected = (per_call * SHAPE.layers * c["microbatches"] * CFG.steps
                * c["dp"] * c["tp"] * c["cp"])
    sent = sum(row["wire_bytes"] for row in rep["comm_by_dim"] if row["dim"] == "cp")
    assert sent == pytest.approx(expected, rel=1e-9), (sent, expected)
    return True


def activations_match_theory(rep):
    """The worst rank's activations against the planner's (its cp term: s / cp tokens per
    rank). The planner models eager attention, which keeps the (h/tp) (s/cp) s b softmax per
    layer; the ring keeps q, k, v, out and the fp32 log-sum-exp of its s / cp tokens instead
    (theory_cp.attention_saved_bytes): the two may differ by at most that gap per layer."""
    c = rep["config"]
    mb, heads = CFG.global_batch // (c["dp"] * c["microbatches"]), SHAPE.heads // c["tp"]
    softmax = 4 * heads * SHAPE.seq // c["cp"] * SHAPE.seq * mb
    ring = theory_cp.attention_saved_bytes(mb, heads, SHAPE.seq, SHAPE.hidden // SHAPE.heads,
                                           c["cp"], dtype_bytes=4)
    worst = max(m["activations"] for m in rep["memory"].values())
    predicted = rep["predicted_memory"]["activations"]
    assert abs(worst - predicted) <= SHAPE.layers * abs(ring - softmax), (worst, predicted)
    return worst, predicted


def test_cp_x_dp_from_the_cli_equals_one_device(capsys):
    argv = ["run", "hybrid", "--dp", "2", "--tp", "1", "--pp", "1", "--cp", "2", "--json"]
    assert cli.main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["world_size"] == 4 and rep["config"]["cp_layout"] == "zigzag"
    assert equals_one_device(rep)
    # the ring sends on cp; the gradients are averaged once over dp x cp, not over dp alone
    assert {("cp", "send"), ("dp_cp", "all_reduce")} <= ops(rep)
    assert not {d for d, _ in ops(rep)} & {"dp", "other"}
    assert cp_bytes_match_ring(rep) and activations_match_theory(rep)
    assert rep["predicted_cp_wire_bytes"] == pytest.approx(
        sum(row["wire_bytes"] for row in rep["comm_by_dim"] if row["dim"] == "cp"))


def test_cp_x_tp_with_sequence_parallel_contiguous_equals_one_device():
    rep = run(dp=1, tp=2, pp=1, cp=2, sequence_parallel=True, cp_layout="contiguous")
    assert equals_one_device(rep)
    assert {("tp", "reduce_scatter"), ("cp", "send")} <= ops(rep)
    assert cp_bytes_match_ring(rep)


def test_cp_x_pp_with_zero1_equals_one_device_and_sends_shards_between_stages():
    rep = run(dp=1, tp=1, pp=2, cp=2, zero=1)
    assert equals_one_device(rep)
    # ZeRO-1 shards the optimizer state over dp x cp: its broadcasts run on dp_cp
    assert {("dp_cp", "all_reduce"), ("dp_cp", "broadcast")} <= ops(rep)
    assert "other" not in {d for d, _ in ops(rep)}
    assert states_match_theory(rep, ("params", "optimizer"))
    # each boundary sends a micro-batch's activations of s / cp tokens, forward and back
    c = rep["config"]
    sends = sum(row["bytes"] for row in rep["comm_by_dim"] if row["dim"] == "pp" and
                row["op"] == "send")
    per_message = (CFG.global_batch // c["microbatches"]) * SHAPE.seq // 2 * SHAPE.hidden * 4
    boundaries = 1   # pp = 2 stages
    assert sends == 2 * boundaries * c["microbatches"] * CFG.steps * 2 * per_message
    assert cp_bytes_match_ring(rep)


def test_fsdp_x_tp_x_pp_x_cp_on_16_ranks_equals_one_device():
    rep = run(dp=2, tp=2, pp=2, cp=2, zero=3, optimizer="sgd")
    assert rep["world_size"] == 16
    assert equals_one_device(rep)
    assert {("tp", "all_reduce"), ("pp", "send"), ("cp", "send"),
            ("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter")} <= ops(rep)
    assert cp_bytes_match_ring(rep)
    # FullyShard shards over dp_shard x cp = 4 ranks (torchtitan's dp_shard_cp)
    assert dp_bytes_match_theory(rep) and states_match_theory(rep, ("params", "grads"))


def test_hsdp_x_cp_shards_over_dp_shard_x_cp_and_averages_across_replicas():
    rep = run(dp=4, tp=1, pp=1, cp=2, zero=3, dp_replicate=2, optimizer="sgd")
    assert rep["world_size"] == 8
    assert equals_one_device(rep)
    assert {("cp", "send"), ("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
            ("dp_replicate", "all_reduce")} <= ops(rep)
    assert all(row["measured"]["dp_replicate"] > 0 for row in rep["dp_comm_by_rank"])
    assert cp_bytes_match_ring(rep)
    # FullyShard shards over dp_shard x cp = 2 x 2 ranks; the replicas average their shards
    assert dp_bytes_match_theory(rep) and states_match_theory(rep, ("params", "grads"))


def ep_bytes_match_plan_terms(rep):
    """The `ep` bytes sent (summed over ranks) against plan_terms.ep_all_to_all_bytes for this
    rank's s / cp tokens of its micro-batch (4 all-to-alls per MoE layer and micro-batch:
    dispatch and combine, forward and backward) plus the miniature's derived extra: before
    each dispatch the mesh all-gathers every rank's top_k x experts + 1 int64 routing counts
    (theory/miniature_terms.py); for each layer, micro-batch, step and dp x tp x cp rank."""
    c = rep["config"]
    m = ModelShape(name="tiny", display_name="tiny", arch="mixtral", layers=SHAPE.layers,
                   hidden=SHAPE.hidden, heads=SHAPE.heads, kv_heads=SHAPE.heads, ffn=SHAPE.ffn,
                   vocab=SHAPE.vocab, experts=c["experts"], top_k=c["top_k"])
    tokens = CFG.global_batch // (c["dp"] * c["microbatches"]) * SHAPE.seq // c["cp"]
    a2a = 4 * wire_bytes_per_rank("all_to_all", terms.ep_all_to_all_bytes(m, tokens, 4),
                                  c["ep"])
    counts = wire_bytes_per_rank("all_gather", 8 * (m.top_k * m.experts + 1), c["ep"])
    expected = ((a2a + counts) * SHAPE.layers * c["microbatches"] * CFG.steps
                * c["dp"] * c["tp"] * c["cp"])
    sent = sum(row["wire_bytes"] for row in rep["comm_by_dim"] if row["dim"] == "ep")
    assert sent == pytest.approx(expected, rel=1e-9), (sent, expected)
    return True


def test_cp_x_ep_x_dp_x_pp_equals_one_device():
    rep = run(dp=2, tp=1, pp=2, cp=2, ep=2, experts=4, top_k=2, optimizer="sgd")
    assert rep["world_size"] == 8
    assert equals_one_device(rep)
    # each cp rank routes its own shard over ep; the experts' replicas span cp (ep_dp)
    assert {("ep", "all_to_all"), ("cp", "send"), ("pp", "send"), ("dp_cp", "all_reduce"),
            ("ep_dp", "all_reduce")} <= ops(rep)
    assert "other" not in {d for d, _ in ops(rep)}
    assert ep_bytes_match_plan_terms(rep) and cp_bytes_match_ring(rep)


def test_activations_per_rank_fall_with_cp_as_the_planner_says():
    (two, two_model), (four, four_model) = (activations_match_theory(run(dp=1, tp=1, pp=1,
                                                                         cp=cp))
                                            for cp in (2, 4))
    # every saved tensor is per token, the planner's and the ring's alike: the measured ratio
    # is the planner's (1% for the few bytes that are not, e.g. a shard's odd alignment)
    assert four / two == pytest.approx(four_model / two_model, rel=0.01)
    assert four_model / two_model == pytest.approx(0.5)


@pytest.mark.parametrize("argv, message", [
    (["--cp", "0"], "--cp must be a positive integer, got 0"),
    (["--cp", "3"], "--cp 3 does not cut the sequence of 32 tokens into 6 equal chunks"),
    (["--cp", "16", "--cp-layout", "contiguous", "--tp", "4", "--sequence-parallel"],
     "TP degree 4 does not divide seq / cp=2"),
    (["--cp", "2", "--tp", "2", "--sequence-parallel", "--cp-layout", "contiguous",
      "--dp", "1", "--pp", "1", "--world-size", "2"], "--world-size 2 but dp x tp x pp x cp"),
])
def test_bad_cp_degrees_are_one_line(capsys, argv, message):
    assert cli.main(["run", "hybrid", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=1, tp=1, pp=1, cp=True), "cp must be a positive integer, got True"),
    (dict(dp=1, tp=1, pp=1, cp=4, seq=12), "cp=4 does not cut the sequence of 12 tokens"),
    (dict(dp=1, tp=1, pp=1, cp=2, cp_layout="striped"), "cp_layout must be one of"),
    (dict(dp=2, tp=2, pp=2, cp=2, world_size=8), "world_size=8 but dp x tp x pp x cp = 16"),
])
def test_validator_names_the_cp_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        validate_dims(**kwargs)
