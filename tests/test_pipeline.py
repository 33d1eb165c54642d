"""Pipeline parallelism: schedules as data (theory), the block (PipelineStage + PipelineSchedule)
on models it was not written for, in a sub-group and in a plain spawn program, the driver's
report and its one-line errors, the exercise checker and the explorer.

Every run is checked against the same model trained on one device: parameters after 3 steps
within rounding (fp32; labkit.numerics: a few times the float32 single-device run's own error
against the same run in float64). The GPT runs use SGD, where exact agreement is the point: with
Adam the attention key bias (whose true gradient is exactly 0) gets rounding noise, which Adam
turns into steps of lr·noise/(|noise| + eps) (see runs/reference.py).
"""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import cli, models, numerics
from labkit.exercises.pipeline import check_stage_order
from labkit.parallel.pipeline import PipelineSchedule, PipelineStage, split_into_stages
from labkit.runs import pipeline as run_pp
from labkit.runs import reference
from labkit.theory import pipeline as sched
from spawn_helpers import spawn

STEPS, BATCH = 3, 8
GPT = dict(layers=4, hidden=16, heads=2, seq=8, vocab=16, ffn=32)


# ------------------------------------------------------------- models and the reference

def build(kind):
    """'gpt': labkit's TinyGPT; 'mlp': an nn.Sequential of 4 layers (Linear + GELU, the last
    a Linear alone) whose second Linear has a frozen bias."""
    torch.manual_seed(0)
    if kind == "gpt":
        return models.TinyGPT(models.GPTConfig(**GPT))
    mlp = nn.Sequential(*[nn.Sequential(nn.Linear(a, 16), nn.GELU()) for a in (8, 16, 16)],
                        nn.Linear(16, 4))
    mlp[1][0].bias.requires_grad_(False)
    return mlp


def batch(kind, step):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "gpt":
        return (torch.randint(GPT["vocab"], (BATCH, GPT["seq"]), generator=g),
                torch.randint(GPT["vocab"], (BATCH, GPT["seq"]), generator=g))
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def loss_fn(kind):
    if kind == "gpt":
        return lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss


def optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2)


def single_device(kind, opt, dtype=torch.float32):
    model = build(kind).to(dtype)
    optim = optimizer(opt, [q for q in model.parameters() if q.requires_grad])
    for step in range(STEPS):
        x, y = numerics.cast(batch(kind, step), dtype)
        optim.zero_grad()
        loss_fn(kind)(model(x), y).backward()
        optim.step()
    return {k: q.detach() for k, q in model.named_parameters()}


def train_pipeline(ctx, kind, opt, schedule, n_micro, group=None, virtual=1, shapes=False,
                   recompute=False):
    """A learner's loop with the block; returns this rank's parameters by the model's names."""
    g = ctx.group(group)
    model = build(kind)
    n = g.size * virtual
    modules = split_into_stages(model, n, balance="layers" if kind == "mlp" else "params")
    mine = []
    for s in range(g.rank, n, g.size):
        shape = None
        if shapes and s > 0:
            shape = (BATCH // n_micro, 16)
        mine.append(PipelineStage(modules[s], s, n, group=group, input_shape=shape))
    optim = optimizer(opt, [q for st in mine for q in st.parameters() if q.requires_grad])
    pipe = PipelineSchedule(mine, n_micro, loss_fn(kind), schedule=schedule,
                            recompute=recompute)
    losses = []
    for step in range(STEPS):
        x, y = batch(kind, step)
        optim.zero_grad()
        loss = pipe.step(x, target=y)
        optim.step()
        losses.append(None if loss is None else loss.item())
    own = {id(q) for st in mine for q in st.parameters()}
    return dict(params={k: q.detach().clone() for k, q in model.named_parameters()
                        if id(q) in own}, losses=losses, group=g.ranks)


def assert_matches_one_device(per_rank, kind, opt):
    params = {k: v for r in per_rank for k, v in r["params"].items()}
    expected = single_device(kind, opt)
    assert set(params) == set(expected)
    agreement = numerics.compare(params, expected, single_device(kind, opt, torch.float64))
    assert agreement, (kind, opt, str(agreement))
    frozen = [k for k, q in build(kind).named_parameters() if not q.requires_grad]
    for k in frozen:
        assert torch.equal(params[k], expected[k])


# --------------------------------------------------------------------------- 4 ranks

DRIVER_GPT = dict(layers=8, hidden=16, heads=2, seq=8, vocab=8, ffn=64)  # equal stages
DRIVER_CFG = reference.RunConfig(steps=1, global_batch=8, optimizer="sgd", lr=0.1,
                                 model_kwargs=DRIVER_GPT)
DRIVER_RUNS = [dict(schedule="gpipe", microbatches=8), dict(schedule="1f1b", microbatches=8),
               dict(schedule="interleaved", microbatches=8, virtual=2)]


def four_ranks(ctx):
    """GPT on 4 stages (GPipe), the frozen-bias MLP on 4 stages (1F1B, AdamW); then at once
    the MLP in the sub-group {1,3} and the GPT on 2 stages in {0,2}; then the driver's runs."""
    out = dict(gpt4=train_pipeline(ctx, "gpt", "sgd", "gpipe", 4),
               mlp4=train_pipeline(ctx, "mlp", "adamw", "1f1b", 8))
    odd, even = ctx.new_group([1, 3]), ctx.new_group([0, 2])
    if odd is not None:
        out["sub"] = train_pipeline(ctx, "mlp", "adamw", "1f1b", 4, group=odd)
    else:
        out["sub"] = train_pipeline(ctx, "gpt", "sgd", "1f1b", 2, group=even)
    free = sched.comm_free_cluster()
    runs = [dict(r, cluster=free) for r in DRIVER_RUNS] + [dict(schedule="1f1b", microbatches=4)]
    out["driver"] = run_pp.sweep(ctx, DRIVER_CFG, runs)
    return out


@pytest.fixture(scope="module")
def four():
    return labkit.launch(four_ranks, 4, timeout_s=300)


def test_gpt_on_4_stages_gpipe(four):
    assert_matches_one_device([r["gpt4"] for r in four], "gpt", "sgd")


def test_mlp_with_frozen_bias_on_4_stages_1f1b_adamw(four):
    assert_matches_one_device([r["mlp4"] for r in four], "mlp", "adamw")
    assert four[3]["mlp4"]["losses"][0] is not None and four[0]["mlp4"]["losses"][0] is None


def test_sub_groups_1_3_and_0_2_of_4(four):
    assert [four[r]["sub"]["group"] for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert_matches_one_device([four[1]["sub"], four[3]["sub"]], "mlp", "adamw")
    assert_matches_one_device([four[0]["sub"], four[2]["sub"]], "gpt", "sgd")


def test_driver_runs_match_the_reference_and_the_formula(four):
    expected = reference.train(DRIVER_CFG, track_memory=False)
    exact = reference.float64_reference(DRIVER_CFG)
    for i, run in enumerate(DRIVER_RUNS):
        res = run_pp.merge_results([r["driver"][i] for r in four])
        agreement = numerics.compare(res[0]["params"], expected["params"], exact["params"])
        assert agreement, (run, str(agreement))
        # equal stages on free links: the bubble read off the clock is (P-1)/(V*M+P-1) but for
        # the last stage's head (a few % more work), computed here independently
        p, m, v = 4, run["microbatches"], run.get("virtual", 1)
        timeline = [e for r in res for e in r["timeline"]]
        assert sched.timeline_bubble_fraction(timeline) == pytest.approx(
            (p - 1) / (v * m + p - 1), rel=0.10), run
        # stage 0's saved activations: micro-batches in flight x one micro-batch's bytes
        assert res[0]["memory"]["activations"] == pytest.approx(
            res[0]["predicted_activations"], rel=0.05)
    gpipe, one_f = (run_pp.merge_results([r["driver"][i] for r in four])[0] for i in (0, 1))
    assert one_f["memory"]["activations"] < 0.6 * gpipe["memory"]["activations"]


def test_simulator_replays_the_real_virtual_timeline(four):
    res = run_pp.merge_results([r["driver"][-1] for r in four])   # 1F1B on H100 NVLink
    timeline = [e for r in res for e in r["timeline"]]
    sends = [e["end"] - e["start"] for e in timeline if e["kind"] == "send"]
    assert sends and max(sends) == pytest.approx(min(sends))
    simulated = sched.simulate_like(timeline, res[0]["schedule"], t_comm=sends[0])
    real = sorted((e["rank"], e["start"]) for e in sched.pipeline_ops(timeline))
    sim = sorted((e["rank"], e["start"]) for e in sched.pipeline_ops(simulated))
    assert len(real) == len(sim) == 4 * 2 * 4
    for (r1, a), (r2, b) in zip(real, sim):
        assert r1 == r2 and a == pytest.approx(b, rel=1e-6, abs=1e-12)


# --------------------------------------------------------------------------- 2 ranks

def two_ranks(ctx):
    out = dict(interleaved=train_pipeline(ctx, "gpt", "sgd", "interleaved", 4, virtual=2),
               shapes=train_pipeline(ctx, "mlp", "adamw", "gpipe", 2, shapes=True),
               recompute=train_pipeline(ctx, "gpt", "sgd", "1f1b", 4, recompute=True))
    try:
        PipelineStage(nn.Linear(2, 2), 1 - ctx.rank, 2)
    except ValueError as error:
        out["wrong_rank"] = str(error)
    return out


def test_interleaved_given_shapes_and_recompute_on_2_ranks():
    results = labkit.launch(two_ranks, 2, timeout_s=300)
    assert_matches_one_device([r["interleaved"] for r in results], "gpt", "sgd")
    assert_matches_one_device([r["shapes"] for r in results], "mlp", "adamw")
    assert_matches_one_device([r["recompute"] for r in results], "gpt", "sgd")
    assert "stage 1 runs on group rank 1" in results[0]["wrong_rank"]


def _spawned(rank, world_size):
    return train_pipeline(labkit.context(), "mlp", "adamw", "1f1b", 4)


@pytest.mark.numerics
def test_plain_spawn_program_without_launch():
    assert_matches_one_device(spawn(_spawned, 2), "mlp", "adamw")


# ----------------------------------------------------------------- schedules as data

@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_schedules_respect_dependencies_and_simulate_to_the_formula(p, m):
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        if name == "interleaved" and m % p:
            with pytest.raises(ValueError, match="multiple"):
                sched.make_schedule(name, p, m, v)
            continue
        schedule = sched.make_schedule(name, p, m, v)
        for ops in schedule:   # every op once, each forward before its backward on the rank
            assert sorted(ops) == sorted((k, i, c) for k in "FB" for i in range(m)
                                         for c in range(v))
            assert all(ops.index(("F", i, c)) < ops.index(("B", i, c))
                       for i in range(m) for c in range(v))
        timeline = sched.simulate_schedule(schedule, 1 / v, 2 / v)
        done = {(e["name"], e["meta"]["microbatch"], e["meta"]["stage"]): e
                for e in sched.pipeline_ops(timeline)}
        for (kind, i, s), e in done.items():   # each op starts after what it needs ends
            needs = [("forward", i, s - 1)] if kind == "forward" and s else []
            if kind == "backward":
                needs = [("forward", i, s)] + ([("backward", i, s + 1)] if s < p * v - 1
                                               else [])
            assert all(done[n]["end"] <= e["start"] for n in needs)
        assert sched.timeline_bubble_fraction(timeline) == pytest.approx(
            (p - 1) / (v * m + p - 1), abs=1e-12)
        in_flight = [sched.microbatches_in_flight(ops) for ops in schedule]
        if name == "gpipe":
            assert in_flight == [m] * p
        elif name == "1f1b":
            assert in_flight == [min(m, p - r) for r in range(p)]


def test_check_schedule_names_the_problem():
    good = sched.one_f_one_b_schedule(2, 2)
    assert sched.check_schedule(good) == (2, 2, 1)
    bad = [list(ops) for ops in good]
    bad[0] = [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
    bad[1] = [("F", 1, 0), ("F", 0, 0), ("B", 0, 0), ("B", 1, 0)]
    with pytest.raises(ValueError, match="deadlock.*rank 0 at B0.0"):
        sched.check_schedule(bad)
    with pytest.raises(ValueError, match="before F1"):
        sched.check_schedule([good[0], [("F", 0, 0), ("B", 1, 0), ("F", 1, 0), ("B", 0, 0)]])
    with pytest.raises(ValueError, match="never runs B1.0"):
        sched.check_schedule([good[0], good[1][:-1]], microbatches=2)


def test_split_into_stages():
    assert sched.balanced_split([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    gpt = build("gpt")
    stages = split_into_stages(gpt, 4)          # embeddings + 4 blocks + head, by params
    assert [len(s) for s in stages] == [2, 1, 1, 2]
    assert sum(q.numel() for s in stages for q in s.parameters()) == \
        sum(q.numel() for q in gpt.parameters())
    assert [len(s) for s in split_into_stages(build("mlp"), 2, balance="layers")] == [2, 2]
    with pytest.raises(ValueError, match="cannot fill 7"):
        split_into_stages(gpt, 7)
    tied = nn.Sequential(nn.Embedding(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    tied[2].weight = tied[0].weight
    with pytest.raises(ValueError, match="tied"):
        split_into_stages(tied, 2, balance=[2, 1])
    with pytest.raises(TypeError, match="nn.Sequential"):
        split_into_stages(nn.Linear(2, 2), 1)


# --------------------------------------------------------------------- driver and CLI

def test_cli_runs_4_stages_of_a_4_layer_gpt(capsys):
    argv = ["run", "pipeline", "--world-size", "4", "--layers", "4", "--microbatches", "8",
            "--schedule", "1f1b", "--json", "--optimizer", "sgd"]
    assert cli.main(argv) == 0, capsys.readouterr().err[-2000:]
    rep = json.loads(capsys.readouterr().out)
    assert rep["technique"] == "pipeline" and rep["config"]["stages"] == 4
    assert rep["agreement"]["params"]["ok"], rep["agreement"]["params"]["verdict"]
    assert rep["bubble_fraction_formula"] == pytest.approx(3 / 11)
    # on the H100's links a message (~us) dwarfs this model's ops (~ns): nearly all idle
    assert rep["bubble_fraction_free_links"] < rep["bubble_fraction"] < 1
    assert rep["memory"]["0"]["activations"] == pytest.approx(
        rep["predicted_memory"]["activations"], rel=0.05)
    sent = sum(row["bytes"] for row in rep["comm"] if row["op"] == "send")
    assert sent == rep["predicted_comm_bytes_per_rank"]


def test_mistakes_are_one_line_before_ranks_start(capsys):
    assert cli.main(["run", "pipeline", "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "4 pipeline stages need at least 4 GPT layers" in err, err
    cfg = reference.RunConfig(model_kwargs=dict(layers=8))
    for kwargs, message in ((dict(microbatches=0), "--microbatches must be a positive integer"),
                            (dict(microbatches=3), "does not split into 3"),
                            (dict(schedule="interleaved", microbatches=2), "multiple of the"),
                            (dict(stages=2), "--world-size 2")):
        with pytest.raises(ValueError, match=message):
            run_pp.report(4, cfg, **kwargs)


# ------------------------------------------------------------- exercise and explorer

def test_exercise_checker_verdicts():
    right = check_stage_order([f"{k}{m}" for k, m, _ in sched.one_f_one_b_schedule(4, 8)[0]])
    assert right.ok and "exactly 1F1B" in right.message
    gpipe_order = [f"F{i}" for i in range(8)] + [f"B{i}" for i in range(8)]
    hang = check_stage_order(["F0", "B0"] + gpipe_order[1:8] + gpipe_order[9:])
    assert hang.problem == "deadlock" and "rank 0 at B0.0" in hang.message
    assert check_stage_order(gpipe_order[:-1]).problem == "malformed"
    assert check_stage_order(["X"]).problem == "unreadable"


def test_explorer_names_the_right_formula():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from labkit.viz import pipeline_widgets as pw
    for args, formula in (((4, 8, "1f1b", 3, 100.0), "(P-1)/(M+P-1)"),
                          ((8, 24, "interleaved", 4, 1.0), "V = 4"),
                          ((2, 3, "naive", 1, 1.0), "(P-1)/P")):
        fig = plt.figure(figsize=(10, 6))
        text = pw.draw_pipeline(fig, *args)
        assert "bubble (simulated)" in text and formula in text
        plt.close(fig)
