"""What every notebook generator shares: cell constructors, and write-then-execute.

A generator (`NN_name.py` beside this file) lists its cells with `md(...)` and `code(...)` and
calls `write_and_execute(cells, "NN_name.ipynb")`; the notebook is saved with its outputs.
An exercise's answer is a cell of its own tagged `solution` (`code(..., tags=("solution",))`):
the student edition (`make student`) replaces it by a stub that raises NotImplementedError.
"""
import subprocess
import sys
from pathlib import Path

import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1]


def md(text):
    return nbformat.v4.new_markdown_cell(text.strip())


def code(text, tags=()):
    """A code cell; `tags=("solution",)` marks an exercise's answer (`make student` stubs it)."""
    cell = nbformat.v4.new_code_cell(text.strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def write_and_execute(cells, name, timeout_s=300):
    """Write notebooks/`name` from `cells`, then execute it in place (outputs saved)."""
    path = NOTEBOOKS / name
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, path)
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook",
                    "--execute", "--inplace", f"--ExecutePreprocessor.timeout={timeout_s}",
                    str(path)], check=True)
    print(f"wrote and executed {path}")
    return path
