"""The lessons are built from jupytext sources (notebooks/src/*.py) by notebooks/build.py:
each committed notebook holds exactly its source's cells, with ids derived from the cells."""
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "notebooks"))
import build  # noqa: E402  (notebooks/build.py)


def test_every_notebook_is_built_from_its_source():
    out = subprocess.run([sys.executable, str(ROOT / "notebooks" / "build.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    sources = {p.stem for p in (ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py")}
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert sources == notebooks


def test_ids_are_stable_and_local(tmp_path):
    """Building twice gives the same bytes; editing one paragraph changes one cell's id."""
    src = next((ROOT / "notebooks" / "src").glob("00_*.py"))
    first, second = build.from_source(src), build.from_source(src)
    assert nbformat.writes(first) == nbformat.writes(second)
    edited = tmp_path / src.name
    text = src.read_text()
    marker = "# %% [markdown]\n# "
    edited.write_text(text.replace(marker, marker + "Edited. ", 1))
    changed = build.from_source(edited)
    ids_before = [c["id"] for c in first.cells]
    ids_after = [c["id"] for c in changed.cells]
    assert len(ids_before) == len(ids_after)
    assert sum(a != b for a, b in zip(ids_before, ids_after)) == 1
    assert len(set(ids_before)) == len(ids_before)


def test_a_notebook_edited_by_hand_is_caught(tmp_path):
    src = next((ROOT / "notebooks" / "src").glob("01_*.py"))
    nb = build.from_source(src)
    nb.cells[1].source += "\nprint('edited in the .ipynb only')"
    path = tmp_path / f"{src.stem}.ipynb"
    nbformat.write(nb, path)
    assert any("differ" in p for p in build.differences(src, path))


def test_the_readme_lists_every_lesson_in_order():
    """README's lesson table: one row per notebooks/*.ipynb, in order, and nothing else."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## The lessons", 1)[1].split("\n\n", 2)[1]
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert rows == notebooks


def _markdown_and_outputs(stem):
    """A lesson's prose (its markdown cells) and what its executed cells printed."""
    nb = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    prose = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    printed = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            printed.append(out.get("text", ""))
            printed += [str(v) for k, v in out.get("data", {}).items() if k.startswith("text/")]
    return prose, "\n".join(printed)


def test_numbers_the_prose_got_wrong_are_printed_by_code_instead():
    """Issue 42's numbers: each now printed by a cell of its lesson, none typed in its prose
    (a typed number goes stale when the model it came from moves)."""
    typed = {"06_putting_it_together": ["proposes layouts such as ZeRO-3"],
             "09_serving": [],
             "10_serving_systems": ["128 KB per prompt token", "adds ~8 ms", "~5 ms"],
             "11_your_own_model": ["2 all-reduces per layer forward and 2 backward",
                                   "nothing here fits Mixtral"]}
    printed_by_code = {
        "06_putting_it_together": ["plan --stack fsdp2", "the best ZeRO-3 with dp > 1 ranks #",
                                   "lie inside the band, none was fitted to"],
        "09_serving": ["kernel launches", "(sum ", "lie inside the band, none was fitted to"],
        "10_serving_systems": ["with a 400-token prefill in it", "131,072 B = 131.1 KB",
                               "Goodput (TTFT", "second-worst request to the worst"],
        "11_your_own_model": ["per layer and step, fwd: 2 collectives",
                              "per layer and step, bwd: 5 collectives", "within rounding",
                              "fewest H100s"]}
    for stem, words in typed.items():
        prose, printed = _markdown_and_outputs(stem)
        assert "never fitted to" not in printed, stem
        for said in words:
            assert said not in prose, (stem, said)
        for said in printed_by_code[stem]:
            assert said in printed, (stem, said)
    tpot = [line for line in _markdown_and_outputs("09_serving")[1].splitlines()
            if line.strip().startswith("TP 8: TPOT")][0]
    total, terms = tpot.split(" ms = ")[0].rsplit(" ", 1)[1], tpot.split("(sum ")[1]
    assert terms.startswith(total), tpot          # the printed terms add up to the TPOT


def test_lesson_11_shows_the_self_check_refusing_a_plan_that_would_train_wrong():
    """Issue 39: lesson 11 runs Qwen3's plan without the q/k norms' gradient sum, and its cell
    prints parallelize's one-line refusal naming the norm; the preset passes at a measured cost,
    and with the check skipped the wrong plan's gradients are not one device's."""
    prose, printed = _markdown_and_outputs("11_your_own_model")
    refusals = [line for line in printed.splitlines() if line.startswith("SelfCheckError: ")]
    assert len(refusals) == 1, refusals
    assert "would train Qwen3ForCausalLM wrong" in refusals[0]
    assert "the gradient of model.layers.1.self_attn.q_norm.weight is not one device's" \
        in refusals[0], refusals[0]
    costs = [line for line in printed.splitlines() if "the preset passes" in line]
    assert len(costs) == 2 and all(line.endswith("s (measured)") for line in costs), costs
    assert float(costs[0].split("the check costs ")[1].split(" s")[0]) > 0
    table = printed.split("wrong, rank 0", 1)[1]
    assert "NOT within rounding" in table and "preset, rank 1" in printed
    assert "SelfCheckError" not in prose and "3.68e+05" not in prose   # printed, not typed


def test_lesson_06_prints_which_way_the_planner_errs_and_its_step_breakdown():
    """Issue 43: lesson 06's prose types no error of the planner (it goes stale as the pricing
    moves); its cells print the mean signed error's direction, the Table 5 and Llama 3.1 405B
    steps beside their model, and plan --explain's parts, which add up to the step printed."""
    prose, printed = _markdown_and_outputs("06_putting_it_together")
    for stale in ("by about a fifth", "the best fraction of peak its paper reports",
                  "FlashAttention's backward at its forward's efficiency"):
        assert stale not in prose.replace("\n", " "), stale
    for said in ("which way it errs: ", "Table 5, modelled / published step - 1: from ",
                 "full / selective recompute step, modelled vs published: ",
                 "TFLOP/s per GPU make a ", "GEMMs' share of the modelled step: "):
        assert said in printed, said
    signed = float(printed.split("check rows (modelled / published - 1): ")[1].split("%")[0])
    way = printed.split("which way it errs: ")[1].split(" on average")[0]
    assert way == ("optimistic (too fast)" if signed > 0 else "pessimistic (too slow)"), way
    from labkit.theory.planner import EXPLAIN
    lines = printed.split("s (modelled), by part:\n", 1)
    step = float(lines[0].rsplit(", ", 1)[1])
    parts = [float(line.split()[-2]) for line in lines[1].splitlines()[1:1 + len(EXPLAIN)]]
    assert abs(sum(parts) - step) <= 1e-3 + 1e-4 * len(parts), (parts, step)
