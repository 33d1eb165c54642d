"""Thin drivers: labkit's models trained with one building block, checked against the
single-device reference and reported (the CLI, the lessons and the benches call these)."""
