"""Figures and explorers for the lessons: `plots` and `timeline` (Gantt) draw what they are
handed, `widgets` wraps `labkit.theory` in sliders. Modelled numbers and measured numbers are
always labelled so."""
from .plots import comm_bars, memory_stack, speedup_curve, time_split
from .timeline import gantt

__all__ = ["comm_bars", "gantt", "memory_stack", "speedup_curve", "time_split"]
