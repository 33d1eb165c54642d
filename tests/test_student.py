"""The student edition (`make student`, labkit/editions.py): solution cells become stubs and
outputs are cleared. That each lesson's checkers fail on the stubs with their message and pass
on the instructor's solutions is tests/test_exercises.py."""
import ast
import contextlib
import io

import nbformat
import pytest

from labkit import editions

TAGGED = ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09"]   # every lesson has exercises


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


def test_site_links_each_lesson_by_title_with_a_static_explorer(tmp_path):
    lessons = tmp_path / "notebooks"
    lessons.mkdir()
    for prefix in ("05", "07"):
        source = read(editions.NOTEBOOKS, prefix)
        nbformat.write(source, lessons / f"{prefix}_lesson.ipynb")
    with contextlib.redirect_stdout(io.StringIO()):
        index = editions.build_site(tmp_path / "site", folder=lessons)
    text = index.read_text()
    assert 'href="07_lesson.html">07 · When it breaks' in text and 'href="05_lesson.html"' in text
    page = (tmp_path / "site" / "07_lesson.html").read_text()
    assert "The explorer as last drawn" in page and page.count("data:image/png;base64,") >= 2
    assert "application/vnd.jupyter.widget-state+json" in page
