"""Every lesson, run in JupyterLab in headless Chromium: run all without error output, every
widget rendered, the explorer's first slider changes the plot. Run and redraw times are
recorded in build/browser-report.json and printed, not asserted."""
import os

import pytest

from lab_server import ROOT
from lesson_driver import drive_lesson, problems

LESSONS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").glob("*.ipynb"))
# Run-all, per lesson: well above the slowest lesson's run s on 2 busy cores (see the report).
RUN_TIMEOUT_S = float(os.environ.get("BROWSER_RUN_TIMEOUT", "180"))


def test_there_are_lessons():
    assert LESSONS, "no notebooks/*.ipynb found"


@pytest.mark.parametrize("notebook", LESSONS, ids=lambda n: n.split("/")[-1][:2])
def test_lesson_in_browser(notebook, time_left, page, lab, record, screens):
    workspace = "check-" + notebook.split("/")[-1][:2]
    row = drive_lesson(page, lab, notebook, workspace, screens,
                       run_timeout_s=min(RUN_TIMEOUT_S, time_left))
    record(row)
    found = problems(row)
    assert not found, f"{notebook}:\n  " + "\n  ".join(found)
