"""The student edition (`make student`, labkit/editions.py): solution cells become stubs and
outputs are cleared. That each lesson's checkers fail on the stubs with their message and pass
on the instructor's solutions is tests/test_exercises.py."""
import ast
import contextlib
import importlib.util
import io
import json

import nbformat
import pytest

from labkit import editions

# every lesson has exercises
TAGGED = ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11"]


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    with contextlib.redirect_stdout(io.StringIO()):
        editions.build_student(out)
    return out


def solution_cells(nb):
    return [c for c in nb.cells if "solution" in c.metadata.get("tags", [])]


def read(folder, prefix):
    path = next(p for p in editions.lessons(folder) if p.name.startswith(prefix + "_"))
    return nbformat.read(path, as_version=4)


@pytest.mark.parametrize("prefix", TAGGED)
def test_solutions_are_stubbed_and_outputs_cleared(student, prefix):
    teacher, pupil = read(editions.NOTEBOOKS, prefix), read(student, prefix)
    answers, stubs = solution_cells(teacher), solution_cells(pupil)
    assert answers and len(stubs) == len(answers)
    for answer, stub in zip(answers, stubs):
        assert stub.source != answer.source
        assert "NotImplementedError" in stub.source or "= None" in stub.source
        ast.parse(stub.source)
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in pupil.cells if c.cell_type == "code")
    assert len(pupil.cells) == len(teacher.cells)


def test_stub_keeps_signatures_and_blanks_answers():
    stub = editions.stub_source('def f(ctx, x):\n    """doc"""\n    return x * 2\n\nn = 3  # ok\n')
    assert stub.splitlines() == ['def f(ctx, x):', '    """doc"""',
                                 '    raise NotImplementedError("your code here")', '',
                                 'n = None   # your answer']
    assert editions.stub_source("print(1)") == 'raise NotImplementedError("your code here")'


def two_lessons(tmp_path):
    lessons = tmp_path / "notebooks"
    lessons.mkdir()
    for prefix in ("05", "07"):
        nbformat.write(read(editions.NOTEBOOKS, prefix), lessons / f"{prefix}_lesson.ipynb")
    return lessons


HUB = "https://hub.example.org/"


def test_the_book_lists_each_lesson_with_its_explorer_and_a_hub_link(tmp_path):
    book = tmp_path / "book"
    names = editions.book_sources(book, folder=two_lessons(tmp_path), hub=HUB)
    assert names == ["05_lesson", "07_lesson"]
    toc = json.loads((book / "_toc.yml").read_text())   # JSON is YAML
    assert toc["root"] == "intro" and [c["file"] for c in toc["chapters"]] == names
    config = json.loads((book / "_config.yml").read_text())
    assert config["execute"]["execute_notebooks"] == "off"      # the saved outputs, not re-run
    assert f'href="{HUB}hub/"' in config["html"]["announcement"]
    assert "- [07 · When it breaks" in (book / "intro.md").read_text()
    nb = nbformat.read(book / "07_lesson.ipynb", as_version=4)
    assert f"({HUB}hub/user-redirect/lab/tree/student/07_lesson.ipynb)" in nb.cells[0].source
    snapshots = [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs if "The explorer as last drawn" in o.get("data", {}).get(
                     "text/html", "")]
    assert snapshots and "data:image/png;base64," in snapshots[0]
    bare = tmp_path / "bare"
    editions.book_sources(bare, folder=tmp_path / "notebooks")
    assert "announcement" not in json.loads((bare / "_config.yml").read_text())["html"]
    first = nbformat.read(bare / "07_lesson.ipynb", as_version=4).cells[0].source
    assert "hub" not in first and first.startswith("# 07")


@pytest.mark.skipif(importlib.util.find_spec("jupyter_book") is None,
                    reason="Jupyter Book is the docs extra (make html installs it)")
def test_the_site_builds_with_search_navigation_and_the_hub_link(tmp_path):
    with contextlib.redirect_stdout(io.StringIO()):
        index = editions.build_site(tmp_path / "site", folder=two_lessons(tmp_path), hub=HUB)
    site = index.parent
    assert (site / "search.html").exists() and (site / "searchindex.js").exists()
    page = (site / "07_lesson.html").read_text()
    assert "The explorer as last drawn" in page and 'href="05_lesson.html"' in page
    assert f"{HUB}hub/user-redirect/lab/tree/student/07_lesson.ipynb" in page
    assert "bd-toc" in page or "On this page" in page or "Contents" in page
