"""ZeRO stages 1-3 as lesson 04 runs them (labkit.runs.zero on DataParallel, ShardedOptimizer and
FullyShard): parameters equal one device for every stage, fp32 and mixed precision, on 2 and 4
ranks; bytes per rank = the layout the blocks hold (the ZeRO formulas up to padding); comm per
step = the per-buffer plan (3Ψ, 2Ψ, 3Ψ); stage 3's gathered layer and prefetch in the measured
peak; overlap on the timeline; offload; the CLI and its one-line errors.

The machine is small and busy, so each world size is launched once and runs all its
configurations one after the other, with fresh instruments (comm log, memory, clock) each.
"""
import json

import pytest
import torch

import labkit
from labkit import cli, numerics
from labkit.exercises.zero import check_stage_memory_answer
from labkit.runs import reference, zero
from labkit.runtime.clock import Clock
from labkit.runtime.comm import Comm
from labkit.runtime.memory import MemoryTracker
from labkit.theory import hardware
from labkit.theory import zero as tz

STEPS = 3
# SGD at lr 0.05 moves the tiny GPT's parameters by ~3e-3 in three steps: ten times the
# mixed-precision tolerance, so a wrong gradient cannot hide inside it.
SGD = reference.RunConfig(steps=STEPS, global_batch=8, optimizer="sgd", lr=0.05)
ADAM = reference.RunConfig(steps=STEPS, global_batch=8)
# Layers of 33*65+65, 65*31+31 and 31*7+7 parameters: none divides by 4, so padding shows.
ODD_MLP = reference.RunConfig(model="mlp", steps=STEPS, global_batch=8, optimizer="sgd",
                              model_kwargs=dict(dims=(33, 65, 31, 7)))
STAGES = zero.STAGES


def runs_for(n):
    """name -> (cfg, train keyword arguments) for a launch on n ranks."""
    runs = {f"mixed sgd {s}": (SGD, dict(stage=s, mixed_precision=True)) for s in STAGES}
    if n == 2:
        runs.update({f"sgd {s}": (SGD, dict(stage=s)) for s in STAGES})
        runs["mixed adam 3"] = (ADAM, dict(stage=3, mixed_precision=True))
        runs["offload"] = (ADAM, dict(stage=3, mixed_precision=True, offload=True))
        runs["no prefetch"] = (SGD, dict(stage=3, prefetch=False))
    else:
        runs.update({f"adam {s}": (ADAM, dict(stage=s)) for s in STAGES})
        runs["odd mlp 3"] = (ODD_MLP, dict(stage=3))
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
        per_rank = labkit.launch(_many, n, runs_for(n), timeout_s=600)
        _RESULTS[n] = {name: [r[name] for r in per_rank] for name in per_rank[0]}
    return _RESULTS[n]


def ref(cfg, mixed=False):
    key = (repr(cfg), mixed)
    if key not in _REFERENCES:
        _REFERENCES[key] = (reference.train_mixed_precision(cfg, zero.COMPUTE_DTYPE) if mixed
                            else reference.train(cfg))
    return _REFERENCES[key]


def diff(res, expected):
    return reference.max_param_diff(res[0]["params"], expected["params"])


def within_rounding(res, cfg):
    """fp32 parameters and loss against one device, judged against the float64 run by float32's
    own error there (labkit.numerics)."""
    key = (repr(cfg), "float64")
    if key not in _REFERENCES:
        _REFERENCES[key] = reference.float64_reference(cfg)
    exact = _REFERENCES[key]
    params = numerics.compare(res[0]["params"], ref(cfg)["params"], exact["params"])
    loss = numerics.compare_loss(zero.global_loss(res), ref(cfg)["loss"], exact["loss"])
    assert params, str(params)
    assert loss, str(loss)
    return True


# ----------------------------------------------------------------------------- correctness

@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_matches_the_single_device_reference(stage):
    assert within_rounding(results(2)[f"sgd {stage}"], SGD)
    # Adam on 4 ranks: one fc1 weight has a gradient near Adam's eps, where the summation
    # order's rounding is a visible share of the step; the float32 reference rounds there too.
    assert within_rounding(results(4)[f"adam {stage}"], ADAM)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_mixed_precision_parameters_match_one_device_mixed_precision(n, stage):
    """bf16 compute, fp32 masters from the unrounded weights: the parameters, not just the
    loss (which a missing gradient sync would pass)."""
    expected = ref(SGD, mixed=True)
    init = reference.full_params(reference.build_model(SGD))
    assert reference.max_param_diff(init, expected["params"]) > 1e-3   # training moved them
    assert diff(results(n)[f"mixed sgd {stage}"], expected) < 1e-4


def test_mixed_precision_adam_differs_from_one_device_only_where_adam_amplifies_rounding():
    """Adam divides by sqrt(v): where a gradient is near its bf16 rounding noise, the two
    summation orders give steps of different sign, up to ~lr. Most elements still agree."""
    got, expected = results(2)["mixed adam 3"][0]["params"], ref(ADAM, mixed=True)["params"]
    gaps = torch.cat([(got[k] - expected[k]).abs().reshape(-1) for k in expected])
    assert (gaps < 1e-4).float().mean() > 0.8
    assert gaps.max() < 3 * ADAM.lr * STEPS


def test_bad_input_is_one_line_before_any_rank_starts(capsys):
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        zero.report(2, SGD, stage=4)
    with pytest.raises(ValueError, match="does not split into 3 ranks"):
        zero.report(3, SGD, stage=1)
    for argv, words in ((["--stage", "0"], "stage must be"), (["--world-size", "3"], "split"),
                        (["--offload"], "--stage 3")):
        assert cli.main(["run", "zero", *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------- memory

def layout_bytes(res, name, n):
    """What the blocks hold per rank after a step (padded flat buffers), by category."""
    padded, psi = res[0]["padded_numel"], res[0]["param_count"]
    mixed, adam = name.startswith("mixed"), "adam" in name
    stage = int(name[-1])
    if stage == 3:   # fp32 shards (the masters) and their fp32 gradients
        return dict(params=4 * padded // n, grads=4 * padded // n,
                    optimizer=(8 if adam else 0) * padded // n)
    w, k = (2, 4 + (8 if adam else 0)) if mixed else (4, 8 if adam else 0)
    if stage == 2:   # full flat buckets, the gradient shard, the state of the shard
        return dict(params=w * padded, grads=w * padded // n, optimizer=k * padded // n)
    return dict(params=w * psi, grads=w * psi, optimizer=None)   # stage 1: whole tensors


@pytest.mark.parametrize("name", [f"adam {s}" for s in STAGES]
                         + [f"mixed sgd {s}" for s in STAGES] + ["odd mlp 3"])
def test_bytes_per_rank_follow_the_zero_formulas(name):
    n = 4
    res = results(n)[name]
    cfg, kwargs = runs_for(n)[name]
    predicted = tz.state_bytes(res[0]["param_count"], n, kwargs["stage"], cfg.optimizer,
                               kwargs.get("mixed_precision", False))
    exact = layout_bytes(res, name, n)
    for r in res:
        mem = r["memory"]
        for cat in ("params", "grads", "optimizer"):
            if exact[cat] is not None:
                assert mem[cat] == exact[cat], (name, cat)
            # stage 1 gives whole tensors to ranks: balanced to within a few per cent
            assert mem[cat] == pytest.approx(predicted[cat], rel=0.05, abs=1), (name, cat)
        assert mem["buffers"] == 0     # nothing transient is left after the step


def test_padding_remainder_is_what_the_layer_sizes_say():
    res = results(4)["odd mlp 3"]
    units = res[0]["flat_numels"]
    assert units == [33 * 65 + 65, 65 * 31 + 31, 31 * 7 + 7]
    # 2210 and 2046 leave 2 over a multiple of 4, 224 divides: 4 padding elements in all
    assert res[0]["padded_numel"] - sum(units) == sum(-u % 4 for u in units) == 4
    assert within_rounding(res, ODD_MLP)


def forward_samples(res):
    samples = res["step_memory"]
    return samples[:[phase for phase, _ in samples].index("after forward")]


def test_stage3_peak_holds_a_gathered_layer_and_the_prefetch():
    res = results(2)["sgd 3"][0]
    block = sum(p.numel() for p in reference.build_model(SGD).blocks[0].parameters())
    # in forward, block 0 is gathered for its compute while block 1 is already being prefetched
    both = next(s for phase, s in res["step_memory"] if phase == "+prefetch blocks.1")["buffers"]
    assert both >= 2 * 4 * block   # two fp32 copies of a block's weights at once
    assert max(s["buffers"] for _, s in forward_samples(res)) == both
    steady = sum(res["memory"][c] for c in ("params", "grads", "optimizer"))
    assert res["memory"]["peak"] > steady + res["memory"]["activations"] * 0.9
    # without prefetch forward holds one gathered layer at a time, and computes the same
    no_prefetch = results(2)["no prefetch"]
    assert max(s["buffers"] for _, s in forward_samples(no_prefetch[0])) < both
    assert within_rounding(no_prefetch, SGD)


# ----------------------------------------------------------------------------- communication

def wire(res, op=None):
    return sum(row["wire_bytes_per_rank"] for row in res[0]["comm"] if op in (None, row["op"]))


@pytest.mark.parametrize("n", [2, 4])
def test_comm_per_step_is_3psi_2psi_3psi(n):
    runs = results(n)
    prefix = "sgd" if n == 2 else "adam"
    psi = runs[f"{prefix} 1"][0]["param_count"]
    for stage, ops in ((1, {"all_reduce", "broadcast"}), (2, {"reduce_scatter", "all_gather"}),
                       (3, {"reduce_scatter", "all_gather"})):
        res = runs[f"{prefix} {stage}"]
        measured = wire(res)
        plan = tz.plan_wire_bytes(tz.comm_plan(res[0]["flat_numels"], n, stage, 4), n) * STEPS
        assert measured == pytest.approx(plan, rel=1e-12)
        assert measured == pytest.approx(tz.formula_wire_bytes(psi, n, stage, 4) * STEPS,
                                         rel=0.01)
        assert {row["op"] for row in res[0]["comm"]} == ops
    calls = {row["op"]: row["calls"] for row in runs[f"{prefix} 3"][0]["comm"]}
    units = len(runs[f"{prefix} 3"][0]["flat_numels"])
    assert calls == {"all_gather": 2 * units * STEPS, "reduce_scatter": units * STEPS}
    assert wire(runs[f"{prefix} 3"]) / wire(runs[f"{prefix} 2"]) == pytest.approx(1.5, rel=1e-3)
    assert wire(runs[f"{prefix} 1"]) / wire(runs[f"{prefix} 2"]) == pytest.approx(1.5, rel=1e-3)
    for stage in STAGES:   # bf16 on the wire: half the bytes
        assert wire(runs[f"mixed sgd {stage}"]) == pytest.approx(
            wire(runs[f"{prefix} {stage}"]) / 2, rel=1e-3)


def test_async_collectives_overlap_compute_on_the_timeline():
    for name, op, phase in (("sgd 2", "reduce_scatter", "backward"),
                            ("sgd 3", "all_gather", "forward")):
        events = results(2)[name][0]["timeline"]
        computes = [e for e in events if e["kind"] == "compute" and e["name"] == phase]
        comms = [e for e in events if e["lane"] == "comm" and e["name"] == op]
        assert comms, name
        assert any(b["start"] < c["end"] and c["start"] < b["end"]
                   for c in comms for b in computes), f"{name}: no {op} during {phase}"


# ----------------------------------------------------------------------------------- offload

def test_offload_keeps_shards_gradients_and_optimizer_state_off_the_device():
    res, same = results(2)["offload"], results(2)["mixed adam 3"]
    padded = res[0]["padded_numel"]
    for r in res:
        assert all(r["memory"][c] == 0 for c in ("params", "grads", "optimizer"))
        # host: fp32 shards, their fp32 gradients, Adam's two moments
        assert r["offloaded_bytes"] == (4 + 4 + 8) * padded // 2
    link = hardware.link(zero.OFFLOAD_LINK)
    copies = [e for e in res[0]["timeline"] if e["name"].startswith("offload")]
    units = res[0]["flat_numels"]
    assert len(copies) == 3 * len(units) * STEPS   # 2 gathers down, 1 gradient up, per unit
    shard_bytes = {2 * tz.padded(u, 2) // 2 for u in units}
    for e in copies:
        assert any(e["end"] - e["start"] == pytest.approx(link.latency + b /
                                                          link.effective_bandwidth)
                   for b in shard_bytes)
    assert reference.max_param_diff(res[0]["params"], same[0]["params"]) == 0.0   # where, not what


# --------------------------------------------------------------------------------------- CLI

@pytest.mark.numerics
def test_cli_json_report(capsys):
    assert cli.main(["run", "zero", "--stage", "3", "--world-size", "2", "--steps", "2",
                     "--optimizer", "sgd", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["technique"] == "zero" and rep["config"]["stage"] == 3
    assert rep["agreement"]["params"]["ok"], rep["agreement"]["params"]["verdict"]
    for cat in ("params", "grads", "optimizer"):
        assert rep["memory"]["0"][cat] == pytest.approx(rep["predicted_memory"][cat], rel=0.02)
    measured = sum(row["wire_bytes_per_rank"] for row in rep["comm"])
    assert measured == pytest.approx(rep["predicted_comm_bytes_per_rank"], rel=1e-12)
    assert measured == pytest.approx(rep["formula_comm_bytes_per_rank"], rel=0.01)


# ---------------------------------------------------------------------------------- exercise

def test_exercise_checker_names_the_mistake():
    llama = dict(params=8.03e9, world_size=8, stage=2, verbose=False)
    right = (2 + 14 / 8) * 8.03e9
    assert check_stage_memory_answer(right, **llama).ok
    for answer, problem, words in ((None, "no answer", "Hint"), ("lots", "not a number", "number"),
                                   (right / 1e9, "units", "in GB"),
                                   (16 * 8.03e9, "another layout", "baseline"),
                                   ((4 + 12 / 8) * 8.03e9, "another layout", "stage 1"),
                                   (123.0, "wrong value", "expected")):
        check = check_stage_memory_answer(answer, **llama)
        assert not check and check.problem == problem and words in check.message
