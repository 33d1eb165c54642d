"""Lesson 04's exercise: the bytes of model states per GPU under a ZeRO stage.

`check_stage_memory_answer(answer, params, world_size, stage)` compares the learner's number
with `theory.memory.model_state_bytes` and, when it is wrong, names the mistake it matches
(the baseline, another stage, a forgotten master copy, fp32 weights, GB instead of bytes).
"""
from ..theory import memory as tm
from . import Check, say


def stage_memory_answer(params, world_size, stage, mixed_precision=True):
    """The expected model-state bytes per GPU (theory.memory.model_state_bytes, Adam)."""
    return tm.model_state_bytes(params, mixed_precision=mixed_precision, zero_stage=stage,
                                world_size=world_size)["total"]


def _feedback(answer, params, world_size, stage, mixed_precision):
    """(problem, message): problem is "" when the answer is right."""
    if answer is None:
        return "no answer", (
            "No answer yet. Hint: with mixed-precision Adam every parameter costs 2 bytes "
            "(bf16 weight) + 2 bytes (bf16 gradient) + 12 bytes (fp32 master, momentum, "
            f"variance). Which of the three does stage {stage} divide by N = {world_size}?")
    try:
        value = float(answer)
    except (TypeError, ValueError):
        return "not a number", f"Give a number of bytes (an int or a float), not {answer!r}."
    expected = stage_memory_answer(params, world_size, stage, mixed_precision)
    close = lambda x: abs(value - x) <= 0.01 * abs(x)   # noqa: E731
    if close(expected):
        return "", (f"Correct: {value / 1e9:,.2f} GB per GPU of model states "
                    f"({expected / params:.3g} bytes per parameter).")
    if close(expected / 1e9):
        return "units", f"Right number, but in GB: the answer is asked in bytes ({expected:,.0f})."
    n = world_size
    w, k = (2, 12) if mixed_precision else (4, 8)
    known = {
        "the baseline without ZeRO (nothing divided by N)": (2 * w + k) * params,
        "stage 1 (only the optimizer state divided by N)": (2 * w + k / n) * params,
        "stage 2": (w + (w + k) / n) * params,
        "stage 3 (the weights divided by N as well)": (2 * w + k) * params / n,
        "stage 2 without the fp32 master copy (K = 8 instead of 12)":
            (w + (w + k - 4) / n) * params,
        "stage 2 with the weights in fp32 (4 bytes)": (4 + (w + k) / n) * params,
    }
    for name, nbytes in known.items():
        if name != f"stage {stage}" and close(nbytes):
            return "another layout", (
                f"Not quite: {value:,.0f} bytes is {name}. Which states does stage {stage} "
                "shard, and which does every GPU keep whole?")
    return "wrong value", (
        f"Not quite: {value:,.0f} bytes is {value / expected:.3g}x the expected value. Per "
        f"parameter: weights {w} B, gradients {w} B, optimizer state {k} B; stage {stage} "
        f"divides {'the last two' if stage == 2 else 'some of them'} by N = {n}.")


def check_stage_memory_answer(answer, params, world_size, stage=2, mixed_precision=True,
                              verbose=True):
    """Say in words whether `answer` (bytes of model states per GPU) is right; never raises.

    Right means within 1% of theory.memory.model_state_bytes. Returns a `Check` (and prints it).
    """
    try:
        problem, message = _feedback(answer, params, world_size, stage, mixed_precision)
    except Exception as error:   # feedback, never a traceback in the learner's notebook
        problem = "error"
        message = f"Could not check this answer ({type(error).__name__}: {error})."
    return say(Check(problem == "", problem, message), verbose)
