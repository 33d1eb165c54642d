"""The lab's two other editions of the executed lessons (notebooks/NN_*.ipynb), both made with
nbconvert's own exporters and preprocessors:

- `python -m labkit.editions html [site]`: every lesson rendered to static HTML (plots are the
  PNGs saved in the notebook; widgets' last state embedded for ipywidgets' renderer, plus a
  static picture of each explorer's last drawing for reading offline) and an index page
  linking them by title (`make html`).
- `python -m labkit.editions student [student]`: the student edition (`make student`). A cell
  tagged `solution` keeps its function signatures, whose bodies become
  `raise NotImplementedError("your code here")`; its top-level answers (`name = value`) become
  `name = None`; anything else becomes the raise alone. Cells tagged `instructor` are removed
  (TagRemovePreprocessor) and all outputs cleared (ClearOutputPreprocessor).
"""
import ast
import html
import sys
from pathlib import Path

import nbformat
from nbconvert.preprocessors import ClearOutputPreprocessor, Preprocessor, TagRemovePreprocessor

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
        nbformat.write(nb, out / path.name)
        written.append(out / path.name)
    print(f"wrote the student edition of {len(written)} lessons into {out}/")
    return written


# ------------------------------------------------------------------------------------ html site

INDEX = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>labkit: the lessons</title>
<style>body {{ font-family: sans-serif; max-width: 46em; margin: 3em auto; line-height: 1.5 }}
li {{ margin: 0.4em 0 }}</style></head>
<body><h1>labkit: distributed training, lesson by lesson</h1>
<p>The lessons as executed, to read without running them. To run and change them:
<code>make lab</code>.</p>
<ol start="0">
{items}
</ol></body></html>
"""


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


def build_site(out="site", folder=NOTEBOOKS):
    """Render every executed lesson to `out`/NN_name.html and write `out`/index.html."""
    from nbconvert import HTMLExporter
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="lab")
    items = []
    for path in lessons(folder):
        nb = nbformat.read(path, as_version=4)
        name = title(nb, path.stem)
        nb, _ = WidgetSnapshots(enabled=True)(nb, {})
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": name}})
        (out / f"{path.stem}.html").write_text(body, encoding="utf-8")
        items.append(f'<li><a href="{path.stem}.html">{html.escape(name)}</a></li>')
    (out / "index.html").write_text(INDEX.format(items="\n".join(items)), encoding="utf-8")
    print(f"rendered {len(items)} lessons into {out}/ (open {out}/index.html)")
    return out / "index.html"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("html", "student"):
        sys.exit("usage: python -m labkit.editions html|student [OUTPUT_FOLDER]")
    build = build_site if argv[0] == "html" else build_student
    build(*argv[1:2])


if __name__ == "__main__":
    main()
