"""Build the lessons: notebooks/src/NN_name.py (jupytext py:percent) -> notebooks/NN_name.ipynb.

The source of a lesson is its py:percent file: `# %% [markdown]` cells of prose, `# %%` code
cells, `# %% tags=["solution"]` for an exercise's answer (`make student` stubs those). Edit it
in any editor, or open the .ipynb in JupyterLab: jupytext pairs the two (notebooks/jupytext.toml)
and saves both.

Each built notebook is saved executed, with
- stable cell ids: a hash of the cell's kind and text (a repeat gets a suffix), so an edited
  paragraph changes one cell in the diff and nothing else;
- the hash of its source in `metadata.labkit.source_sha1`: `make notebooks` re-executes only the
  lessons whose source changed (`--force` all of them, or name lessons: `build.py 03 08`).
`build.py --check` exits 1 when a notebook's cells differ from its source (a test runs it).
"""
import argparse
import hashlib
import sys
from pathlib import Path

import jupytext
import nbformat

NOTEBOOKS = Path(__file__).resolve().parent
SOURCES = NOTEBOOKS / "src"
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def source_sha1(src):
    return hashlib.sha1(src.read_bytes()).hexdigest()


def stable_ids(cells):
    """A cell's id from its kind and text; the n-th repeat of the same cell gets `-n`."""
    seen = {}
    for cell in cells:
        digest = hashlib.sha1(f"{cell.cell_type}\0{cell.source}".encode()).hexdigest()[:12]
        seen[digest] = seen.get(digest, 0) + 1
        cell["id"] = digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"
    return cells


def from_source(src):
    """The notebook a source describes, not executed: stable ids, kernelspec, source hash."""
    nb = jupytext.read(src)
    nb.nbformat, nb.nbformat_minor = 4, 5
    stable_ids(nb.cells)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["jupytext"] = {"formats": "ipynb,src//py:percent"}
    nb.metadata["labkit"] = {"source_sha1": source_sha1(src)}
    return nb


def cell_key(cell):
    return cell.cell_type, cell.source, cell.get("id"), cell.metadata.get("tags", [])


def differences(src, ipynb):
    """Why `ipynb` is not the executed form of `src` ([] when it is)."""
    if not ipynb.exists():
        return [f"{ipynb.name} is missing"]
    built, saved = from_source(src), nbformat.read(ipynb, as_version=4)
    problems = []
    built_from = saved.metadata.get("labkit", {}).get("source_sha1")
    if built_from != built.metadata["labkit"]["source_sha1"]:
        problems.append(f"{ipynb.name} was built from another version of {src.name}")
    if [cell_key(c) for c in built.cells] != [cell_key(c) for c in saved.cells]:
        problems.append(f"{ipynb.name}'s cells differ from {src.name}")
    return problems


def execute(nb, timeout_s):
    from nbconvert.preprocessors import ExecutePreprocessor
    ExecutePreprocessor(timeout=timeout_s, kernel_name="python3", record_timing=False).preprocess(
        nb, {"metadata": {"path": str(NOTEBOOKS)}})
    return nb


def build(src, force=False, timeout_s=300):
    """Execute and save the notebook of `src` unless it is already built from this source."""
    ipynb = NOTEBOOKS / f"{src.stem}.ipynb"
    if not force and not differences(src, ipynb):
        print(f"up to date: {ipynb.name}")
        return False
    nb = execute(from_source(src), timeout_s)
    nbformat.write(nb, ipynb)
    print(f"built and executed: {ipynb.name}")
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lessons", nargs="*", help="lesson numbers or names (default: all)")
    parser.add_argument("--force", action="store_true", help="execute even if up to date")
    parser.add_argument("--check", action="store_true", help="only check notebooks = sources")
    args = parser.parse_args(argv)
    sources = sorted(SOURCES.glob("[0-9][0-9]_*.py"))
    if args.lessons:
        sources = [s for s in sources if any(s.stem.startswith(n) for n in args.lessons)]
    if args.check:
        problems = [p for s in sources for p in differences(s, NOTEBOOKS / f"{s.stem}.ipynb")]
        print("\n".join(problems) or f"{len(sources)} notebooks match their sources")
        return 1 if problems else 0
    for src in sources:
        build(src, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
