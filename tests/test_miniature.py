"""Plans run in miniature (runs/miniature.py): for each layout the mesh's measured memory by
category and bytes per mesh dimension equal the planner's own terms on the tiny shape (after the
differences the module derives), the run itself equals one device (labkit.numerics), and what
the mesh cannot run is refused in one line before any rank starts."""
import subprocess
import sys

import pytest

from labkit import cli
from labkit.runs import miniature as mini

EXACT = ("params", "grads", "optimizer", "pp bytes", "dp bytes", "dp_shard bytes",
         "dp_cp bytes", "cp bytes", "ep bytes")

# each dimension at least once: dp, tp, pp, cp, ep, interleaved v, ZeRO 1, 2 and 3, SP, tp x ep
SHAPES = {
    "fsdp x tp x pp": dict(dp=2, tp=2, pp=2, zero_stage=3),
    "zero1 x tp+sp x pp": dict(dp=2, tp=2, pp=2, zero_stage=1, sequence_parallel=True),
    "dp x pp interleaved": dict(dp=2, pp=2, v=2),
    "dp x ep": dict(dp=2, ep=2),
    # CP with experts: each cp rank routes its shard; experts (and ZeRO-1's shards of their
    # state) averaged over their dp x cp / ep replicas
    "dp x cp x ep": dict(dp=2, cp=2, ep=2),
    "zero1 x dp x cp x ep": dict(dp=2, cp=2, ep=2, zero_stage=1),
    "zero1 x dp x ep": dict(dp=2, ep=2, zero_stage=1),
    # expert TP: each expert split over tp (the planner's stage_parameters, experts / ep tp)
    "dp x tp x ep": dict(dp=2, tp=2, ep=2),
    # ZeRO-3 with experts: the blocks sharded over dp x cp, the experts over their replicas
    "fsdp x dp x ep": dict(dp=4, ep=2, zero_stage=3),
    "fsdp x dp x cp x ep": dict(dp=2, cp=2, ep=2, zero_stage=3),
    "pp=4 (uneven stages)": dict(pp=4),
    "tp+sp x pp interleaved": dict(tp=2, pp=2, v=2, sequence_parallel=True),
    "dp x tp": dict(dp=2, tp=2),
    "cp": dict(cp=2),
    "tp+sp x cp": dict(tp=2, cp=2, sequence_parallel=True),
    "zero1 x pp x cp": dict(pp=2, cp=2, zero_stage=1),
    # DP x TP x PP x CP together: 16 ranks (a few seconds each on 2 cores)
    "zero1 x tp+sp x pp x cp": dict(dp=2, tp=2, pp=2, cp=2, zero_stage=1,
                                    sequence_parallel=True),
    "fsdp x tp x pp x cp": dict(dp=2, tp=2, pp=2, cp=2, zero_stage=3),
    # ZeRO-2: a reduce-scatter of the gradients per micro-batch (2 here), the planner's too
    "zero2 x tp+sp x cp": dict(dp=2, tp=2, cp=2, zero_stage=2, sequence_parallel=True),
    # full recompute: every forward collective twice (TP, the CP ring, EP's all-to-alls)
    "recompute x tp+sp x pp x cp": dict(tp=2, pp=2, cp=2, sequence_parallel=True,
                                        recompute="full"),
    "recompute x dp x ep": dict(dp=2, ep=2, recompute="full"),
    # selective recompute: the attention cores again, no collective (the ring left alone)
    "selective x dp x tp x pp": dict(dp=2, tp=2, pp=2, recompute="selective"),
    "selective x tp+sp x pp x cp": dict(tp=2, pp=2, cp=2, sequence_parallel=True,
                                        recompute="selective"),
    # full recompute of k of L layers per stage: the share kept (3 of 12: 1 of 4 blocks),
    # each checkpointed block's forward collectives twice
    "3 of 12 x dp x tp": dict(dp=2, tp=2, recompute="full", recompute_layers=3,
                              layers_per_stage=12),
    "1 of 2 x tp+sp x pp x cp": dict(tp=2, pp=2, cp=2, sequence_parallel=True, recompute="full",
                                     recompute_layers=1, layers_per_stage=2),
}


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def run(request):
    return mini.miniature(SHAPES[request.param])


def test_equals_one_device(run):
    for name in ("loss", "params"):
        assert run["report"]["agreement"][name]["ok"], run["report"]["agreement"][name]


def test_memory_and_bytes_equal_the_planners(run):
    rows = {r["what"]: r for r in run["rows"]}
    for what in EXACT:
        if what in rows:
            assert rows[what]["verdict"] == "equal", mini.format_rows(run)
            assert rows[what]["measured"] == pytest.approx(rows[what]["adjusted"], rel=1e-9)
    assert rows["tp bytes"]["verdict"] == "equal", mini.format_rows(run)
    low, high = mini.ACTIVATION_BAND
    assert low <= rows["activations"]["ratio"] <= high, mini.format_rows(run)


def test_derived_differences_vanish_where_the_layouts_agree():
    """dp=2 alone (no TP, no pipeline): the only derived difference is the final LayerNorm's
    bias, h parameters (4h bytes in fp32); each TP or pipeline option adds its own."""
    side = mini.planner_side(dict(mini.DEFAULTS, dp=2))
    h = side["model"].hidden
    assert side["adjusted"]["params"] - side["memory"]["params"] == 4 * h
    tp = mini.planner_side(dict(mini.DEFAULTS, tp=2))
    assert tp["adjusted"]["params"] - tp["memory"]["params"] > 4 * tp["model"].hidden


def test_full_recompute_drops_the_activations_as_the_planner_says():
    """dp=2 x pp=2: two micro-batches in flight on the first stage; full recompute keeps only
    inputs. The planner (every layer's input) and the mesh (each stage's input, the whole
    stage rebuilt: the derived number) both say the activations fall; measured, they do, to
    within a tenth of the derived ratio."""
    drop = mini.recompute_drop(dict(dp=2, pp=2))
    assert drop["planner"] < 0.75 and drop["adjusted"] < 0.75, mini.format_drop(drop)
    assert drop["measured"] == pytest.approx(drop["adjusted"], rel=0.1), mini.format_drop(drop)
    for run in drop["runs"].values():
        assert run["report"]["agreement"]["loss"]["ok"], run["report"]["agreement"]


def test_selective_recompute_drops_less_than_full():
    """dp=2 x tp=2 x pp=2: selective recompute keeps every activation but the attention
    cores', so the measured activations fall below none's and stay above full's; the planner's
    a_selective (less the rebuilt core the tracker cannot see) says how far, within 5%."""
    selective = mini.recompute_drop(dict(dp=2, tp=2, pp=2), mode="selective")
    full = mini.recompute_drop(dict(dp=2, tp=2, pp=2), mode="full", runs=selective["runs"])
    assert full["measured"] < selective["measured"] < 1, (mini.format_drop(selective),
                                                          mini.format_drop(full))
    assert selective["measured"] == pytest.approx(selective["adjusted"], rel=0.05), \
        mini.format_drop(selective)
    for run in full["runs"].values():
        assert run["report"]["agreement"]["params"]["ok"], run["report"]["agreement"]


def test_selective_recompute_leaves_the_ring_alone():
    """tp=2 x cp=2: the ring core keeps no scores (q, k, v, out, lse), so selective recompute
    does not checkpoint it: the activations are none's to the byte and the cp bytes carry no
    extra hop (the planner counts extra hops for fully recomputed layers only)."""
    drop = mini.recompute_drop(dict(tp=2, cp=2), mode="selective")
    assert drop["measured"] == 1.0 == drop["adjusted"], mini.format_drop(drop)
    rows = [{r["what"]: r for r in run["rows"]}["cp bytes"] for run in drop["runs"].values()]
    assert rows[0]["measured"] == rows[1]["measured"] == rows[1]["adjusted"]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_ring_adjustment_is_the_rings_last_hop(cp):
    """The derived CP difference (one hop: dK, dV carried home) is what separates the planner's
    cp_ring_bytes from the ring's own formula (theory/context_parallel, in fp32)."""
    from labkit.theory import context_parallel as ring, plan_terms
    side = mini.planner_side(dict(mini.DEFAULTS, cp=cp))
    m, run = side["model"], side["run"]
    per_call = ring.comm_bytes_per_rank(run["mbs"], m.heads, run["seq"], m.head_dim, cp,
                                        dtype_bytes=4, grad_bytes=4)["total"]
    planner_b, adjusted = side["comm"]["cp"]
    assert adjusted == pytest.approx(per_call * m.layers * run["microbatches"], rel=1e-12)
    tokens = run["mbs"] * run["seq"] // cp
    assert planner_b == run["microbatches"] * m.layers * plan_terms.cp_ring_bytes(
        m, tokens, 1, cp, 4)["total"] < adjusted


@pytest.mark.parametrize("fields, words", [
    (dict(dp=4, tp=2, pp=2, cp=2), "32 ranks"),
    (dict(dp=2, pp=2, zero_stage=2), "zero_stage=2 with pp > 1"),
    (dict(dp=2, ep=2, zero_stage=2), "zero_stage=2 with ep > 1"),
    (dict(dp=0), "dp must be a positive integer"),
    (dict(pp=4, recompute="full", recompute_layers=3, layers_per_stage=12), "3 of 12 layers"),
    (dict(dp=2, recompute="full", recompute_layers=1, layers_per_stage=9), "over 8 layers"),
])
def test_refused_in_one_line(fields, words):
    with pytest.raises(ValueError) as err:
        mini.miniature(fields, timeout_s=1)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_cli_refuses_past_the_launcher(capsys):
    code = cli.main(["plan", "--model", "gpt2-small", "--gpus", "32", "--global-batch", "32",
                     "--seq", "1024", "--top", "1", "--miniature"])
    out, err = capsys.readouterr()
    assert code == 2 and "legal plans" in out
    assert err.strip().count("\n") == 0 and "at most 16 CPU ranks" in err


def test_plan_imports_no_torch_without_miniature():
    code = ("import sys; from labkit import cli; cli.main(['plan', '--model', 'gpt2-small', "
            "'--gpus', '8', '--global-batch', '32', '--top', '1']); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_cli_runs_the_fixed_plan_in_miniature(capsys):
    """`plan --miniature` on 16 GPUs: DP x TP x PP x CP, every exact row equal."""
    code = cli.main(["plan", "--model", "gpt2-small", "--gpus", "16", "--global-batch", "16",
                     "--seq", "1024", "--top", "1", "--miniature",
                     "--fix", "dp=2,tp=2,pp=2,cp=2,zero_stage=1,recompute=none"])
    out = capsys.readouterr().out
    assert code == 0 and "legal plans" in out and "in miniature" in out
    rows = [line.split() for line in out.splitlines()
            if line.startswith(("params", "grads", "optimizer", "tp ", "pp ", "dp_cp ", "cp "))]
    assert [r[0] for r in rows] == ["params", "grads", "optimizer", "tp", "pp", "dp_cp", "cp"]
    assert [r[-1] for r in rows] == ["equal"] * 7, out
