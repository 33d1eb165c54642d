"""ZeRO stages 1-3 (labkit.zero): the same parameters as the single-device reference for every
stage and N = 1, 2, 4; bytes per rank = the ZeRO paper's formulas (padding explained); comm per
step 2Ψ (stages 1, 2) and 3Ψ (stage 3) from the log; stage 3's gathered layer and prefetch in
the measured peak; overlap on the timeline; CPU offload; the CLI.

The machine is small and busy, so each world size is launched once and runs all its
configurations one after the other, with fresh instruments (comm log, memory, clock) each.
"""
import json

import pytest
import torch

import labkit
from labkit import cli, zero
from labkit.runs import reference
from labkit.runtime.clock import Clock
from labkit.runtime.comm import Comm
from labkit.runtime.memory import MemoryTracker
from labkit.theory import hardware
from labkit.theory import memory as tm
from labkit.theory import time as theory_time

# SGD: the update is linear in the gradient, so float32 rounding stays ~1e-9 in the parameters.
SGD = reference.RunConfig(steps=2, global_batch=8, optimizer="sgd")
ADAM = reference.RunConfig(steps=2, global_batch=8)
# Layers of 33*65+65, 65*31+31 and 31*7+7 parameters: none divides by 2 or 4, so padding shows.
ODD_MLP = reference.RunConfig(model="mlp", steps=2, global_batch=8,
                              model_kwargs=dict(dims=(33, 65, 31, 7)))


def runs_for(n):
    """name -> (cfg, train keyword arguments) for a launch on n ranks."""
    runs = {f"sgd stage {s}": (SGD, dict(stage=s)) for s in zero.STAGES}
    runs.update({f"mixed stage {s}": (ADAM, dict(stage=s, mixed_precision=True))
                 for s in zero.STAGES})
    if n > 1:
        runs.update({f"adam stage {s}": (ADAM, dict(stage=s)) for s in zero.STAGES})
        runs["odd mlp stage 3"] = (ODD_MLP, dict(stage=3))
        runs["odd mlp stage 1"] = (ODD_MLP, dict(stage=1))
    if n == 2:
        runs["mixed sgd stage 2"] = (SGD, dict(stage=2, mixed_precision=True))
        runs["offload stage 2"] = (ADAM, dict(stage=2, mixed_precision=True, offload=True))
        runs["stage 1 all_reduce"] = (SGD, dict(stage=1, grad_sync="all_reduce"))
        runs["stage 3 no prefetch"] = (SGD, dict(stage=3, prefetch=False))
    return runs


def _many(ctx, runs):
    out = {}
    for name, (cfg, kwargs) in runs.items():
        ctx.comm, ctx.memory = Comm(ctx), MemoryTracker(ctx)
        ctx.clock = Clock(ctx, ctx.clock.cluster.name)
        out[name] = zero.train(ctx, cfg, **kwargs)
    return out


_RESULTS, _REFERENCES = {}, {}


def results(n):
    """{run name: [rank results]} for world size n (launched once per n)."""
    if n not in _RESULTS:
        per_rank = labkit.launch(_many, n, runs_for(n), timeout_s=300)
        _RESULTS[n] = {name: [r[name] for r in per_rank] for name in per_rank[0]}
    return _RESULTS[n]


def ref(cfg, mixed=False):
    key = (repr(cfg), mixed)
    if key not in _REFERENCES:
        _REFERENCES[key] = zero.reference_mixed_precision(cfg) if mixed else reference.train(cfg)
    return _REFERENCES[key]


def diff_without_key_bias(params, expected, hidden):
    """Max |difference|, skipping the attention key bias: softmax cancels it, so its gradient is
    rounding noise (~1e-10) that Adam normalises into steps of ~lr in any summation order."""
    worst = 0.0
    for name, p in params.items():
        q = expected[name]
        if name.endswith("attn.qkv.bias"):
            p, q = torch.cat([p[:hidden], p[2 * hidden:]]), torch.cat([q[:hidden], q[2 * hidden:]])
        worst = max(worst, (p - q).abs().max().item())
    return worst


# ----------------------------------------------------------------------------- correctness

@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("stage", zero.STAGES)
def test_every_stage_matches_the_single_device_reference(n, stage):
    res = results(n)[f"sgd stage {stage}"]
    expected = ref(SGD)
    assert reference.max_param_diff(res[0]["params"], expected["params"]) < 1e-5
    assert zero.global_loss(res) == pytest.approx(expected["loss"], abs=1e-5)
    if n > 1:
        hidden = reference.build_model(ADAM).cfg.hidden
        adam = results(n)[f"adam stage {stage}"]
        # At N = 4 one fc1 weight has a gradient near Adam's eps, where the summation order's
        # rounding is a visible share of the step: 1.8e-5 after two steps (lr 1e-2).
        tol = 1e-5 if n == 2 else 5e-5
        assert diff_without_key_bias(adam[0]["params"], ref(ADAM)["params"], hidden) < tol
        odd = results(n)[f"odd mlp stage {3 if stage == 3 else 1}"]
        assert reference.max_param_diff(odd[0]["params"], ref(ODD_MLP)["params"]) < 1e-5


@pytest.mark.parametrize("stage", zero.STAGES)
def test_mixed_precision_matches_its_own_single_device_algorithm(stage):
    expected = ref(ADAM, mixed=True)
    one = results(1)[f"mixed stage {stage}"]
    # N = 1: the same bf16 operations in the same order - identical to the last bit.
    assert reference.max_param_diff(one[0]["params"], expected["params"]) == 0.0
    assert one[0]["loss"] == expected["loss"]
    # N = 2: the bf16 average of two half-batch gradients is rounded differently from the
    # full-batch bf16 gradient. With SGD that stays at the bf16 rounding of one update.
    sgd = results(2)["mixed sgd stage 2"]
    sgd_expected = ref(SGD, mixed=True)
    assert reference.max_param_diff(sgd[0]["params"], sgd_expected["params"]) < 1e-3
    two = results(2)[f"mixed stage {stage}"]
    assert zero.global_loss(two) == pytest.approx(expected["loss"], abs=0.05)


def test_bad_options_are_refused_before_any_work():
    with pytest.raises(ValueError, match="stage"):
        zero.train(None, SGD, stage=4)
    with pytest.raises(ValueError, match="reduce_scatter"):
        zero.train(None, SGD, stage=2, grad_sync="all_reduce")


# ---------------------------------------------------------------------------------- memory

def padded(unit_numels, n):
    return sum(-(-u // n) * n for u in unit_numels)


MEMORY_RUNS = [f"{kind} stage {s}" for kind in ("adam", "mixed") for s in zero.STAGES] + \
    ["odd mlp stage 1", "odd mlp stage 3"]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", MEMORY_RUNS)
def test_bytes_per_rank_follow_the_zero_formulas(n, name):
    res = results(n)[name]
    stage, mixed = int(name[-1]), name.startswith("mixed")
    units = res[0]["unit_numels"]
    psi, psi_padded = sum(units), padded(units, n)
    w = 2 if mixed else 4              # bytes per weight / gradient element
    k = 12 if mixed else 8             # Adam: (fp32 master +) momentum + variance
    formula = tm.model_state_bytes(psi, mixed_precision=mixed, zero_stage=stage, world_size=n)
    # What the padded layout holds exactly: full buffers are padded to a multiple of N,
    # shards are padded / N (fewer than N extra elements per layer).
    exact = dict(params=w * (psi_padded // n if stage == 3 else psi_padded),
                 grads=w * (psi_padded // n if stage >= 2 else psi_padded),
                 optimizer=k * psi_padded // n)
    for r in res:
        mem = r["memory"]
        for cat in ("params", "grads", "optimizer"):
            assert mem[cat] == exact[cat], (name, cat)
            assert mem[cat] == pytest.approx(formula[cat], rel=0.02), (name, cat)
        assert mem["buffers"] == 0     # nothing transient is left after the step


def test_padding_remainder_is_what_the_layer_sizes_say():
    res = results(4)["odd mlp stage 3"]
    units = res[0]["unit_numels"]
    assert units == [33 * 65 + 65, 65 * 31 + 31, 31 * 7 + 7]
    # 2210 and 2046 leave 2 over a multiple of 4, 224 divides: 4 padding elements in all
    assert res[0]["padded_numel"] - sum(units) == sum(-u % 4 for u in units) == 4


def forward_samples(res):
    samples = res["step_memory"]
    end = [phase for phase, _ in samples].index("after forward")
    return samples[:end]


def test_stage3_peak_holds_a_gathered_layer_and_the_prefetch():
    res = results(2)["sgd stage 3"][0]
    block = sum(p.numel() for p in reference.build_model(SGD).blocks[0].parameters())
    # in forward, block 0 is gathered for its compute while block 1 is already being prefetched
    both = next(s for phase, s in res["step_memory"] if phase == "+prefetch blocks.1")["buffers"]
    assert both >= 2 * 4 * block   # two fp32 copies of a block's weights at once
    assert max(s["buffers"] for _, s in res["step_memory"]) >= both
    steady = sum(res["memory"][c] for c in ("params", "grads", "optimizer"))
    assert res["memory"]["peak"] > steady + res["memory"]["activations"] * 0.9
    # without prefetch forward holds one gathered layer at a time
    no_prefetch = results(2)["stage 3 no prefetch"][0]
    assert max(s["buffers"] for _, s in forward_samples(no_prefetch)) < both
    assert max(s["buffers"] for _, s in forward_samples(res)) == both
    assert reference.max_param_diff(no_prefetch["params"], ref(SGD)["params"]) < 1e-5


# ----------------------------------------------------------------------------- communication

def wire(res, op=None):
    return sum(row["wire_bytes_per_rank"] for row in res[0]["comm"] if op in (None, row["op"]))


@pytest.mark.parametrize("n", [2, 4])
def test_comm_per_step_is_2psi_for_stages_1_2_and_3psi_for_stage_3(n):
    runs = results(n)
    units = runs["sgd stage 1"][0]["unit_numels"]
    psi, steps = sum(units), SGD.steps
    dp_all_reduce = theory_time.wire_bytes_per_rank("all_reduce", 4 * psi, n) * steps
    for stage in zero.STAGES:
        res = runs[f"sgd stage {stage}"]
        measured = wire(res)
        assert measured == pytest.approx(
            zero.predicted_wire_bytes(units, n, stage, 4) * steps, rel=1e-12)
        assert measured == pytest.approx(zero.formula_wire_bytes(psi, n, stage, 4) * steps,
                                         rel=0.01)
        ops = {row["op"]: row for row in res[0]["comm"]}
        assert set(ops) == {"reduce_scatter", "all_gather"}
        assert ops["reduce_scatter"]["calls"] == len(units) * steps      # one bucket per layer
        gathers = 2 if stage == 3 else 1
        assert ops["all_gather"]["calls"] == gathers * len(units) * steps
    assert wire(runs["sgd stage 1"]) == pytest.approx(dp_all_reduce, rel=1e-12)  # = DP
    assert wire(runs["sgd stage 3"]) / wire(runs["sgd stage 2"]) == pytest.approx(1.5)
    mixed = runs["mixed stage 2"]            # bf16 on the wire: half the bytes
    assert wire(mixed) == pytest.approx(wire(runs["sgd stage 2"]) / 2, rel=1e-12)


def test_stage1_with_all_reduce_moves_1_5x_the_data():
    runs = results(2)
    res = runs["stage 1 all_reduce"]
    assert {row["op"] for row in res[0]["comm"]} == {"all_reduce", "all_gather"}
    assert wire(res) / wire(runs["sgd stage 1"]) == pytest.approx(1.5)
    assert reference.max_param_diff(res[0]["params"], ref(SGD)["params"]) < 1e-5


def test_async_collectives_overlap_compute_on_the_timeline():
    for name, op, phase in (("sgd stage 2", "reduce_scatter", "backward"),
                            ("sgd stage 3", "all_gather", "forward")):
        events = results(2)[name][0]["timeline"]
        computes = [e for e in events if e["kind"] == "compute" and e["name"] == phase]
        comms = [e for e in events if e["lane"] == "comm" and e["name"] == op]
        assert comms, name
        overlapped = [c for c in comms if any(b["start"] < c["end"] and c["start"] < b["end"]
                                              for b in computes)]
        assert overlapped, f"{name}: no {op} runs during {phase} compute"


# ----------------------------------------------------------------------------------- offload

def test_offload_keeps_optimizer_state_off_the_device_and_pays_pcie():
    res = results(2)["offload stage 2"]
    units = res[0]["unit_numels"]
    psi_padded = padded(units, 2)
    assert res[0]["memory"]["optimizer"] == 0
    assert res[0]["offloaded_bytes"] == 12 * psi_padded // 2   # fp32 master + moments
    link = hardware.link(zero.OFFLOAD_LINK)
    copies = [e for e in res[0]["timeline"] if e["name"].startswith("offload")]
    assert len(copies) == 2 * ADAM.steps
    for e in copies:
        assert e["end"] - e["start"] == pytest.approx(
            link.latency + 2 * psi_padded / 2 / link.effective_bandwidth)
    same = results(2)["mixed stage 2"]       # offload changes where, not what
    assert reference.max_param_diff(res[0]["params"], same[0]["params"]) == 0.0


# --------------------------------------------------------------------------------------- CLI

def test_cli_json_report(capsys):
    cli.main(["run", "zero", "--stage", "3", "--world-size", "2", "--steps", "2",
              "--optimizer", "sgd", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rep["technique"] == "zero" and rep["config"]["stage"] == 3
    assert rep["max_param_diff_vs_reference"] < 1e-5
    for cat in ("params", "grads", "optimizer"):
        assert rep["memory"]["0"][cat] == pytest.approx(rep["predicted_memory"][cat], rel=0.02)
    measured = sum(row["wire_bytes_per_rank"] for row in rep["comm"])
    assert measured == pytest.approx(rep["predicted_comm_bytes_per_rank"], rel=1e-12)
    assert measured == pytest.approx(rep["formula_comm_bytes_per_rank"], rel=0.01)
