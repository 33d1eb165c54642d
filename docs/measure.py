"""The numbers in docs/instructor.md, measured on the machine this runs on.

    .venv/bin/python docs/measure.py lessons        each lesson executed once, in turn (nbconvert)
    .venv/bin/python docs/measure.py mesh-memory    peak memory of the largest core run's processes
    .venv/bin/python docs/measure.py zero3-memory   the same for a 4-rank ZeRO-3 run
    .venv/bin/python docs/measure.py answers        an answer shown before its exercise?

`lessons` prints a Markdown table: the measured wall time of `jupyter nbconvert --execute` per
lesson (kernel start included), the load average around it (a shared machine runs slower), and a
*modelled* participant time from the lesson's size: reading its prose, running and looking at its
code cells, doing its exercises (the rates are below; adjust them to your group).
`mesh-memory` samples the process tree of the largest run of the core agenda, lesson 06's
DP 2 x TP 2 x PP 2 mesh on 8 ranks (`python -m labkit run hybrid --dp 2 --tp 2 --pp 2`), every
50 ms and prints the peaks of the summed RSS (shared pages counted once per process), PSS
(shared pages split between all processes that map them, also other programs') and USS (pages
of these processes alone), and what that means for a shared hub (modelled); `zero3-memory`
does the same for `python -m labkit run zero --stage 3 --world-size 4`.
`answers` looks for each line of a lesson's `solution` cells (longer than 30 characters, not a
comment) in the sources and outputs of the cells before its exercises: none should be there.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS_PER_MINUTE = 150  # reading technical prose and looking at what it points to
MINUTES_PER_CODE_CELL = 0.75  # run it, read its output or plot
MINUTES_PER_EXERCISE = 8.0  # write, check, read the feedback, fix once
HUB_CORES, HUB_MEMORY_GB = 16, 64  # the shared machine of docs/instructor.md
PARTICIPANTS = 30
CORES_PER_PARTICIPANT = 2  # the lessons are timed on 2 cores


def lessons():
    out = Path(tempfile.mkdtemp(prefix="lesson-timings-"))
    rows = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook",
                              "--execute", "--ExecutePreprocessor.timeout=600",
                              "--output", str(out / path.name), str(path)],
                             capture_output=True, text=True)
        seconds = time.perf_counter() - start
        load_after = os.getloadavg()[0]
        size = lesson_size(path)
        rows.append((path.stem, seconds, run.returncode, load_before, load_after, size))
        print(f"{path.stem}: {seconds:.0f} s, rc {run.returncode}", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    print(f"measured {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, lessons of "
          f"commit {commit}; executed copies in {out}\n")
    print("| lesson | run all (measured) | load avg before → after | prose words | code cells "
          "| exercises | participant time (modelled) |")
    print("|---|---|---|---|---|---|---|")
    total_run = total_people = 0.0
    for name, seconds, rc, before, after, (words, cells, exercises) in rows:
        people = participant_minutes(words, cells, exercises)
        total_run += seconds
        total_people += people
        status = "" if rc == 0 else f" (FAILED, exit {rc})"
        print(f"| {name} | {seconds:.0f} s{status} | {before:.1f} → {after:.1f} | {words} "
              f"| {cells} | {exercises} | {people:.0f} min |")
    print(f"| all | {total_run / 60:.1f} min | | | | | {total_people:.0f} min |")


def lesson_size(path):
    """(prose words, code cells, exercises): an exercise is an answer cell tagged `solution`
    (or, in a lesson without tags, a heading with 'Exercise' in it)."""
    cells = json.loads(path.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    words = sum(len(t.split()) for t in text)
    code = sum(c["cell_type"] == "code" for c in cells)
    answers = sum("solution" in c.get("metadata", {}).get("tags", []) for c in cells)
    headings = sum(len(re.findall(r"^#+ .*\bExercise", t, re.M)) for t in text)
    return words, code, answers or headings


def participant_minutes(words, code_cells, exercises):
    return (words / WORDS_PER_MINUTE + code_cells * MINUTES_PER_CODE_CELL
            + exercises * MINUTES_PER_EXERCISE)


MESH_RUN = ["hybrid", "--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2",
            "--steps", "3", "--cluster", "2x4xH100-IB"]           # lesson 06's run, 8 ranks
ZERO3_RUN = ["zero", "--stage", "3", "--world-size", "4"]


def mesh_memory():
    run_memory(MESH_RUN, ranks=8)


def zero3_memory():
    run_memory(ZERO3_RUN, ranks=4)


def run_memory(run, ranks):
    import psutil
    command = [sys.executable, "-m", "labkit", "run", *run]
    parent = psutil.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL)
    peak = {"rss": 0, "pss": 0, "uss": 0}
    most_processes = 0
    while parent.poll() is None:
        tree = [parent] + parent.children(recursive=True)
        now = dict.fromkeys(peak, 0)
        for process in tree:
            try:
                info = process.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for kind in now:
                now[kind] += getattr(info, kind, info.rss)
        peak = {kind: max(peak[kind], now[kind]) for kind in peak}
        most_processes = max(most_processes, len(tree))
        time.sleep(0.05)
    gb = {kind: value / 1e9 for kind, value in peak.items()}
    print(f"{' '.join(command[1:])}: exit {parent.returncode}; up to {most_processes} processes "
          f"(launcher, forkserver, resource tracker, ranks); peak of the summed RSS "
          f"{gb['rss']:.2f} GB, PSS {gb['pss']:.2f} GB, USS {gb['uss']:.2f} GB "
          f"(load average {os.getloadavg()[0]:.1f})")
    usable = 0.8 * HUB_MEMORY_GB
    at_once = HUB_CORES // CORES_PER_PARTICIPANT
    print(f"modelled, a {HUB_CORES}-core {HUB_MEMORY_GB} GB hub: {at_once} participants' "
          f"{ranks}-rank runs at once at 2-core speed; in 80% of its memory the peaks of "
          f"{usable // gb['rss']:.0f} such runs at once (RSS: nothing shared) to "
          f"{usable // gb['uss']:.0f} (USS: torch's libraries shared by all); {PARTICIPANTS} "
          f"participants running the same cell together: each run "
          f"{PARTICIPANTS * CORES_PER_PARTICIPANT / HUB_CORES:.2g}x its 2-core time")


def answers():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        solutions = [i for i, c in enumerate(cells)
                     if "solution" in c.get("metadata", {}).get("tags", [])]
        if not solutions:
            print(f"{path.stem}: no solution cells")
            continue
        first = min(solutions)
        heading = max((i for i, c in enumerate(cells[:first]) if c["cell_type"] == "markdown"
                       and "Exercise" in "".join(c["source"])), default=first)
        answer = "\n".join("".join(cells[i]["source"]) for i in solutions)
        lines = {line.strip() for line in answer.split("\n")
                 if len(line.strip()) > 30 and not line.strip().startswith("#")}
        shown = [(i, line) for i, cell in enumerate(cells[:heading]) for line in lines
                 if line in cell_text(cell)]
        print(f"{path.stem}: " + ("no answer line before the exercises" if not shown else
                                  "; ".join(f"cell {i} shows `{line}`" for i, line in shown)))


def cell_text(cell):
    text = "".join(cell["source"])
    for output in cell.get("outputs", []):
        text += "".join(output.get("text", ""))
        for kind in ("text/plain", "text/markdown", "text/html"):
            text += "".join(output.get("data", {}).get(kind, ""))
    return text


if __name__ == "__main__":
    {"lessons": lessons, "mesh-memory": mesh_memory, "zero3-memory": zero3_memory,
     "answers": answers}[sys.argv[1]]()
