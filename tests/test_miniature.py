"""Plans run in miniature (runs/miniature.py): for each layout the mesh's measured memory by
category and bytes per mesh dimension equal the planner's own terms on the tiny shape (after the
differences the module derives), the run itself equals one device (labkit.numerics), and what
the mesh cannot run is refused in one line before any rank starts."""
import subprocess
import sys

import pytest

from labkit import cli
from labkit.runs import miniature as mini

EXACT = ("params", "grads", "optimizer", "pp bytes", "dp bytes", "dp_shard bytes")

# each dimension at least once: dp, tp, pp, ep, interleaved v, ZeRO 1 and 3, SP
SHAPES = {
    "fsdp x tp x pp": dict(dp=2, tp=2, pp=2, zero_stage=3),
    "zero1 x tp+sp x pp": dict(dp=2, tp=2, pp=2, zero_stage=1, sequence_parallel=True),
    "dp x pp interleaved": dict(dp=2, pp=2, v=2),
    "dp x ep": dict(dp=2, ep=2),
    "pp=4 (uneven stages)": dict(pp=4),
    "tp+sp x pp interleaved": dict(tp=2, pp=2, v=2, sequence_parallel=True),
    "dp x tp": dict(dp=2, tp=2),
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


@pytest.mark.parametrize("fields, words", [
    (dict(dp=2, cp=2), "cp > 1"),
    (dict(dp=2, recompute="full"), "recompute=full"),
    (dict(dp=2, recompute="selective"), "recompute=selective"),
    (dict(dp=4, tp=2, pp=2), "16 ranks"),
    (dict(dp=2, zero_stage=2), "zero_stage=2"),
    (dict(dp=2, ep=2, zero_stage=3), "zero_stage=3 with ep"),
    (dict(dp=0), "dp must be a positive integer"),
])
def test_refused_in_one_line(fields, words):
    with pytest.raises(ValueError) as err:
        mini.miniature(fields, timeout_s=1)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_cli_refuses_past_the_launcher(capsys):
    code = cli.main(["plan", "--model", "gpt2-small", "--gpus", "16", "--global-batch", "32",
                     "--seq", "1024", "--top", "1", "--miniature"])
    out, err = capsys.readouterr()
    assert code == 2 and "legal plans" in out
    assert err.strip().count("\n") == 0 and "at most 8 CPU ranks" in err


def test_plan_imports_no_torch_without_miniature():
    code = ("import sys; from labkit import cli; cli.main(['plan', '--model', 'gpt2-small', "
            "'--gpus', '8', '--global-batch', '32', '--top', '1']); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_cli_runs_the_fixed_plan_in_miniature(capsys):
    code = cli.main(["plan", "--model", "gpt2-small", "--gpus", "2", "--global-batch", "8",
                     "--seq", "1024", "--top", "1", "--miniature",
                     "--fix", "dp=2,zero_stage=1,recompute=none"])
    out = capsys.readouterr().out
    assert code == 0 and "legal plans" in out and "in miniature" in out
    verdicts = [line.split()[-1] for line in out.splitlines()
                if line.startswith(("params", "grads", "optimizer", "dp bytes"))]
    assert verdicts == ["equal"] * 4, out
