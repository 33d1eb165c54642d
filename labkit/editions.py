"""The lab's two other editions of the executed lessons (notebooks/NN_*.ipynb):

- `python -m labkit.editions html [site] [--hub URL] [--hub-folder student]`: the reading site
  (`make html`), a Jupyter Book (1.x: Sphinx and MyST-NB, pure Python; the `docs` extra) of
  the executed lessons, nothing re-run: navigation between lessons, search, a table of contents
  on each page, plots as saved, widgets' last state embedded for ipywidgets' renderer plus a
  static picture of each explorer's last drawing (nbconvert preprocessor), and, given the
  instructor's JupyterHub, a link on each page that opens that lesson there.
- `python -m labkit.editions student [student]`: the student edition (`make student`). A cell
  tagged `solution` keeps its function signatures, whose bodies become
  `raise NotImplementedError("your code here")`; its top-level answers (`name = value`) become
  `name = None`; anything else becomes the raise alone. Cells tagged `instructor` are removed
  (TagRemovePreprocessor) and all outputs cleared (ClearOutputPreprocessor).
"""
import argparse
import ast
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
from nbconvert.preprocessors import ClearOutputPreprocessor, Preprocessor, TagRemovePreprocessor

from .runtime import atomic

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
STUB = 'raise NotImplementedError("your code here")'


def lessons(folder=NOTEBOOKS):
    """The lessons in order: notebooks/NN_name.ipynb."""
    return sorted(p for p in Path(folder).glob("[0-9][0-9]_*.ipynb"))


def title(nb, fallback=""):
    """The first Markdown heading of a notebook, without its #s."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return fallback


# ------------------------------------------------------------------------------ student edition

def stub_source(source):
    """A solution cell's source as the student gets it (see the module docstring)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            body = node.body[0]
            has_doc = isinstance(body, ast.Expr) and isinstance(getattr(body, "value", None),
                                                                ast.Constant) \
                and isinstance(body.value.value, str)
            keep_to = body.end_lineno if has_doc else body.lineno - 1
            indent = " " * body.col_offset
            header = lines[first:keep_to]
            if not has_doc and node.body[0].lineno == node.lineno:  # def f(): return 1
                header = [lines[node.lineno - 1][:body.col_offset].rstrip()]
                indent = " " * (node.col_offset + 4)
            out += header + [indent + STUB, ""]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = " = ".join(ast.get_source_segment(source, t) for t in targets)
            out.append(f"{names} = None   # your answer")
    if not any(line.strip() for line in out):
        return STUB
    return "\n".join(out).rstrip() + "\n"


class StubSolutions(Preprocessor):
    """Replace the source of each cell tagged `solution` by its stub (`stub_source`)."""

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and "solution" in cell.metadata.get("tags", []):
            cell.source = stub_source(cell.source)
        return cell, resources


def student_notebook(nb):
    """The student edition of one notebook node (a copy; `nb` is left as it is)."""
    nb = nbformat.from_dict(nb)
    resources = {}
    for step in (TagRemovePreprocessor(remove_cell_tags={"instructor"}, enabled=True),
                 StubSolutions(enabled=True), ClearOutputPreprocessor(enabled=True)):
        nb, resources = step(nb, resources)
    return nb


def build_student(out="student", folder=NOTEBOOKS):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in lessons(folder):
        nb = student_notebook(nbformat.read(path, as_version=4))
        text = nbformat.writes(nb)   # whole or not at all: a learner never opens half a lesson
        atomic.write_text(out / path.name, text if text.endswith("\n") else text + "\n")
        written.append(out / path.name)
    print(f"wrote the student edition of {len(written)} lessons into {out}/")
    return written


# ------------------------------------------------------------------------------------ html site

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


class WidgetSnapshots(Preprocessor):
    """After each widget output, a static picture of its last state: the text of its HTML
    widgets and the pictures of its Image widgets (PNG bytes saved as a base64 buffer) and
    Output widgets, read from the widget state saved in the notebook. The live widget needs
    ipywidgets' renderer from a CDN and, to redraw, a kernel; the snapshot shows the
    explorer's last drawing also offline."""

    def preprocess(self, nb, resources):
        self.state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
        return super().preprocess(nb, resources)

    def preprocess_cell(self, cell, resources, index):
        outputs = []
        for output in cell.get("outputs", []):
            outputs.append(output)
            view = output.get("data", {}).get(WIDGET_VIEW)
            parts = self._parts(view["model_id"]) if view else []
            if any(part.startswith("<img") for part in parts):   # an explorer, not a bar
                note = ("<p><i>The explorer as last drawn (a static picture: moving its "
                        "controls needs a running kernel, <code>make lab</code>).</i></p>")
                outputs.append(nbformat.v4.new_output(
                    "display_data", {"text/html": note + "\n".join(parts)}))
        if cell.cell_type == "code":
            cell.outputs = outputs
        return cell, resources

    def _parts(self, model_id, seen=None):
        seen = set() if seen is None else seen
        model = self.state.get(model_id)
        if model is None or model_id in seen:
            return []
        seen.add(model_id)
        state, parts = model.get("state", {}), []
        if model.get("model_name") == "HTMLModel" and state.get("value"):
            parts.append(f"<p>{state['value']}</p>")
        if model.get("model_name") == "ImageModel":
            png = next((b["data"] for b in model.get("buffers", [])
                        if b.get("path") == ["value"] and b.get("encoding") == "base64"), None)
            kind = state.get("format", "png")
            if png:
                parts.append(f'<img src="data:image/{kind};base64,{png}">')
        for output in state.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                parts.append(f'<img src="data:image/png;base64,{png.strip()}">')
        for child in state.get("children", []):
            parts += self._parts(str(child).removeprefix("IPY_MODEL_"), seen)
        return parts


BOOK_TITLE = "labkit: distributed training, lesson by lesson"
INTRO = """# {title}

The lessons as executed, to read without running them: every output, plot and explorer is
the one saved in the lesson. To run and change them: `make lab`{hub}.

{items}
"""


WRAP_OUTPUTS = """/* a checker's verdict is one long line: wrap it instead of scrolling sideways */
div.cell_output pre, div.output pre { white-space: pre-wrap; word-break: break-word; }
"""


def launch_link(hub, hub_folder, name):
    """The URL that opens lesson `name` in JupyterLab on the hub (each user's `hub_folder`)."""
    path = "/".join(part for part in (hub_folder.strip("/"), f"{name}.ipynb") if part)
    return f"{hub.rstrip('/')}/hub/user-redirect/lab/tree/{path}"


def book_sources(book, folder=NOTEBOOKS, hub=None, hub_folder="student"):
    """Write a Jupyter Book's sources into `book`: _config.yml and _toc.yml (JSON is YAML),
    intro.md, and each executed lesson with its explorers' static pictures and, given `hub`,
    a first cell that opens it on the hub. Returns the lessons' names in order."""
    book = Path(book)
    book.mkdir(parents=True, exist_ok=True)
    names, items = [], []
    for path in lessons(folder):
        nb = nbformat.read(path, as_version=4)
        nb, _ = WidgetSnapshots(enabled=True)(nb, {})
        if hub:
            link = launch_link(hub, hub_folder, path.stem)
            nb.cells.insert(0, nbformat.v4.new_markdown_cell(
                f"[▶ Open this lesson in JupyterLab on the course hub]({link})",
                id=f"launch-{path.stem[:2]}"))
        nbformat.write(nb, book / path.name)
        names.append(path.stem)
        items.append(f"- [{title(nb, path.stem)}]({path.name})")
    hub_text = f", or on [the course JupyterHub]({hub.rstrip('/')}/hub/)" if hub else ""
    (book / "intro.md").write_text(INTRO.format(title=BOOK_TITLE, hub=hub_text,
                                                items="\n".join(items)), encoding="utf-8")
    config = {"title": BOOK_TITLE, "author": "the labkit authors", "copyright": "",
              "only_build_toc_files": True, "execute": {"execute_notebooks": "off"},
              "html": {"home_page_in_navbar": True},
              "sphinx": {"config": {"html_show_copyright": False, "nb_merge_streams": True,
                                    "suppress_warnings": ["misc.highlighting_failure"]}}}
    if hub:
        config["html"]["announcement"] = (f'Run the lessons on <a href="{hub.rstrip("/")}/hub/">'
                                          "the course JupyterHub</a>")
    (book / "_config.yml").write_text(json.dumps(config, indent=1), encoding="utf-8")
    (book / "_static").mkdir(exist_ok=True)      # Jupyter Book adds _static/*.css to each page
    (book / "_static" / "labkit.css").write_text(WRAP_OUTPUTS, encoding="utf-8")
    toc = {"format": "jb-book", "root": "intro", "chapters": [{"file": n} for n in names]}
    (book / "_toc.yml").write_text(json.dumps(toc, indent=1), encoding="utf-8")
    return names


def build_site(out="site", folder=NOTEBOOKS, hub=None, hub_folder="student"):
    """Build the reading site into `out` with Jupyter Book; returns `out`/index.html."""
    out = Path(out)
    try:
        import jupyter_book  # noqa: F401 - only to say what is missing before anything runs
    except ImportError:
        sys.exit("make html needs Jupyter Book 1.x: pip install -e '.[docs]' (make html does)")
    with tempfile.TemporaryDirectory(prefix="labkit-book-") as tmp:
        book = Path(tmp) / "book"
        names = book_sources(book, folder, hub, hub_folder)
        command = [sys.executable, "-c", "from jupyter_book.cli.main import main; main()",
                   "build", str(book), "--path-output", tmp]
        done = subprocess.run(command, capture_output=True, text=True)
        built = Path(tmp) / "_build" / "html"
        if done.returncode != 0 or not (built / "index.html").exists():
            sys.exit(f"jupyter-book build failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(built, out)
    print(f"built the reading site of {len(names)} lessons into {out}/ (open {out}/index.html"
          + (f"; each page links to {hub}" if hub else "") + ")")
    return out / "index.html"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m labkit.editions")
    parser.add_argument("edition", choices=("html", "student"))
    parser.add_argument("out", nargs="?", help="output folder (site/ or student/)")
    parser.add_argument("--hub", default=None, help="the course JupyterHub's URL (html)")
    parser.add_argument("--hub-folder", default="student",
                        help="the lessons' folder in each user's home on the hub (html)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.edition == "student":
        build_student(args.out or "student")
    else:
        build_site(args.out or "site", hub=args.hub or None, hub_folder=args.hub_folder)


if __name__ == "__main__":
    main()
