"""Figures and explorers for the lessons: `plots` draws what it is handed, `widgets` wraps
`labkit.theory` in sliders. Modelled numbers and measured numbers are always labelled so."""
from .plots import comm_bars, gantt, memory_stack, speedup_curve, time_split

__all__ = ["comm_bars", "gantt", "memory_stack", "speedup_curve", "time_split"]
