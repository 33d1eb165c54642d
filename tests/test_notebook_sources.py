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
