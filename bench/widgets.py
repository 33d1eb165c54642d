"""How long each lesson's explorer takes to redraw after its first slider moves.

For every explorer in labkit.viz: the Python-side time from setting a new value on its first
slider until the explorer's new PNG bytes are in its Image widget (what the browser waits for,
less the transport and the browser's own paint), stepping to the neighbouring value and back.
The explorers take turns in interleaved rounds (the order alternating), so a busy spell of this
shared machine slows them alike. Printed: median, spread (min..max), PNG size, and whether the
step updated the figure in place or had to build it again.
A step back and forth finds the figure's layout made before (labkit.viz.live.Layout); a learner
dragging to values never shown may not, so a second measure walks the first slider once across
its whole range (up to SWEEP values, each shown for the first time: new tick labels, new text)
and reports that walk's median and slowest step, with how many steps had to lay the figure out
again. Two rows per explorer in data/bench.csv (benchmark "widgets").
"""
import os
import statistics
import sys
import time

import matplotlib

matplotlib.use("Agg")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_rounds, replace_rows  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", 15))
SWEEP = 12   # values of the first slider walked once, end to end


def explorers():
    """{lesson explorer name: the function that makes it}: every explorer in labkit.viz."""
    from labkit.viz import (cp_widgets, dp_widgets, moe_widgets, pipeline_widgets,
                            planner_widgets, serving_widgets, tp_widgets, widgets, zero_widgets)
    return {"memory_explorer (00)": widgets.memory_explorer,
            "dp_explorer (01)": dp_widgets.dp_explorer,
            "pipeline_explorer (02)": pipeline_widgets.pipeline_explorer,
            "tp_explorer (03)": tp_widgets.tp_explorer,
            "zero_explorer (04)": zero_widgets.zero_explorer,
            "moe_explorer (05)": moe_widgets.moe_explorer,
            "planner_explorer (06)": planner_widgets.planner_explorer,
            "cp_explorer (08)": cp_widgets.cp_explorer,
            "serving_explorer (09)": serving_widgets.serving_explorer}


def first_slider(box):
    """The first slider among the explorer's controls (the one the browser test moves)."""
    controls = [w for row in box.children[:-2] for w in row.children]
    return next(w for w in controls if "Slider" in type(w).__name__)


def neighbour(slider):
    """The value one step to the right of the slider's value (to the left at its end)."""
    if hasattr(slider, "options"):
        values = [o[1] if isinstance(o, tuple) else o for o in slider.options]
        i = values.index(slider.value)
        return values[i + 1] if i + 1 < len(values) else values[i - 1]
    if "Log" in type(slider).__name__:
        up = slider.value * slider.base ** slider.step
        return up if up <= slider.base ** slider.max else slider.value / slider.base ** slider.step
    up = slider.value + slider.step
    return up if up <= slider.max else slider.value - slider.step


def slider_values(slider, most=SWEEP):
    """Up to `most` of the slider's values, evenly spread from its first to its last."""
    if hasattr(slider, "options"):
        values = [o[1] if isinstance(o, tuple) else o for o in slider.options]
    elif "Log" in type(slider).__name__:
        n = round((slider.max - slider.min) / slider.step)
        values = [slider.base ** (slider.min + i * slider.step) for i in range(n + 1)]
    else:   # IntSlider, FloatSlider
        n = round((slider.max - slider.min) / slider.step)
        values = [slider.min + i * slider.step for i in range(n + 1)]
    if len(values) <= most:
        return values
    return [values[round(i * (len(values) - 1) / (most - 1))] for i in range(most)]


def sweep(box):
    """Walk the first slider across its range once: [ms per step], how many steps laid the
    figure out again, how many built it again."""
    slider = first_slider(box)
    ms, layouts, builds = [], 0, box.live.builds
    for value in slider_values(slider):
        if value == slider.value:
            continue
        layout = box.live.layout
        runs = layout.runs if layout else 0
        start = time.perf_counter()
        slider.value = value
        ms.append((time.perf_counter() - start) * 1e3)
        layouts += box.live.layout is layout and layout is not None and layout.runs > runs
    return ms, layouts, box.live.builds - builds


cpu_seconds = {}   # {box: CPU seconds of each measured step (this thread)}


def stepper(box):
    """measure(): move the first slider one step (then back next time); seconds until the
    new PNG bytes are set."""
    slider = first_slider(box)
    values = [slider.value, neighbour(slider)]
    turn = [0]

    def measure():
        turn[0] += 1
        before = box.image.value
        start, cpu = time.perf_counter(), time.thread_time()
        slider.value = values[turn[0] % 2]
        seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
        assert box.image.value != before, "the picture did not change"
        cpu_seconds.setdefault(box, []).append(cpu)
        return seconds
    return slider, measure


def main():
    boxes = {name: make() for name, make in explorers().items()}
    steppers = {name: stepper(box) for name, box in boxes.items()}
    builds = {name: box.live.builds for name, box in boxes.items()}
    times = interleaved_rounds({name: s[1] for name, s in steppers.items()}, ROUNDS)
    rebuilt = {name: box.live.builds - builds[name] for name, box in boxes.items()}
    walks = {name: sweep(box) for name, box in boxes.items()}
    load = os.getloadavg()[0]
    print(f"redraw after one step of the first slider, Python side, {ROUNDS} interleaved rounds "
          f"({os.cpu_count()} cores, load {load:.1f})")
    rows = []
    for name, box in boxes.items():
        ms = [t * 1e3 for t in times[name]]
        med = statistics.median(ms)
        how = ("in place" if rebuilt[name] == 0
               else f"rebuilt {rebuilt[name]} of {ROUNDS + 1} steps")
        cpu = statistics.median(cpu_seconds[box][1:]) * 1e3   # [0] is the warm-up round
        kb = len(box.image.value) / 1024
        slider = steppers[name][0].description
        print(f"  {name:<24} {slider:<20} median {med:6.1f} ms  ({min(ms):.1f}..{max(ms):.1f})"
              f" CPU {cpu:5.1f} ms  {kb:4.0f} KB PNG  {how}")
        rows.append(dict(benchmark="widgets", labkit_impl=name, world_size=1,
                         metric="redraw_ms_first_slider", labkit=f"{med:.1f}", rounds=ROUNDS,
                         notes=f"slider '{slider}'; spread {min(ms):.1f}..{max(ms):.1f} ms; "
                               f"CPU median {cpu:.1f} ms; "
                               f"{kb:.0f} KB PNG; {how}; Python side (set value until the "
                               f"PNG bytes are set); {os.cpu_count()} shared cores, "
                               f"load {load:.1f}"))
    print(f"the first slider walked once across its range (up to {SWEEP} values, each new)")
    for name, (ms, layouts, built) in walks.items():
        med = statistics.median(ms)
        print(f"  {name:<24} median {med:6.1f} ms  slowest {max(ms):6.1f} ms over {len(ms)} "
              f"steps: {layouts} laid out again, {built} built again")
        rows.append(dict(benchmark="widgets", labkit_impl=name, world_size=1,
                         metric="redraw_ms_first_slider_sweep", labkit=f"{med:.1f}",
                         rounds=len(ms),
                         notes=f"first slider walked once over {len(ms)} new values; slowest "
                               f"{max(ms):.1f} ms; {layouts} steps laid the figure out again, "
                               f"{built} built it again; "
                               f"Python side; {os.cpu_count()} shared cores, load {load:.1f}"))
    replace_rows(rows)


if __name__ == "__main__":
    main()
