"""The browser run's report: build/browser-report.json (every row as measured) and
build/browser-report.md (the table), and the same table for the terminal.

Times are reported, never asserted: they depend on the machine and on what else runs on it.
"""
import json
import os
import platform
import time

COLUMNS = ("lesson", "run s", "errors", "widgets", "slider changes plot", "median redraw ms")


def _cells(row):
    """One table row (strings) from one lesson's report row."""
    if "failure" in row:
        return (row["lesson"], str(row.get("run_s", "-")), "run failed", "-", "-", "-")
    widgets = f"{row['widgets_rendered']}/{row['widgets']}"
    if row["widgets_closed"]:
        widgets += f" ({row['widgets_closed']} closed)"
    if row.get("explorer_cell", -1) < 0:
        moved = "no explorer"
    elif not row.get("slider_found"):
        moved = "no slider"
    else:
        moved = "yes" if row["slider_changes_plot"] else "NO"
    median = row.get("median_redraw_ms")
    steps = row.get("redraws_ms") or []
    redraw = "-" if median is None else f"{median:.0f} (of {len(steps)} steps)"
    return (row["lesson"], f"{row['run_s']:.1f}", str(len(row["errors"])), widgets, moved,
            redraw)


def table(rows):
    """A markdown table of `rows`, one line per lesson."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def machine():
    """Where the numbers were measured (they mean little without it)."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def write(rows, folder, browser_version, total_s):
    """Write the JSON and markdown reports into `folder`; the markdown text."""
    folder.mkdir(parents=True, exist_ok=True)
    about = dict(machine(), browser=browser_version, total_s=round(total_s, 1))
    (folder / "browser-report.json").write_text(
        json.dumps({"machine": about, "lessons": rows}, indent=1) + "\n")
    text = (f"# Lessons in a real browser\n\nMeasured on {about['cpus']} CPU(s), "
            f"Chromium {browser_version}, {about['when']}, {about['total_s']} s in all. "
            "Run s: run-all to the last cell done; median redraw: from the slider's key press to "
            "the last DOM change of the explorer's output (reported, not asserted); widgets: "
            "rendered of shown (closed: a widget the kernel closed after use, e.g. a progress "
            "bar).\n\n" + table(rows) + "\n")
    (folder / "browser-report.md").write_text(text)
    return text
