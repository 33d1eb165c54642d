"""Exercise checkers: each runs a learner's code (or reads their number) and answers with a
`Check`: ok or not, a one-word problem, and advice in plain words, printed by `say`.

Code exercises run the learner's function on ranks (`labkit.launch`) and diagnose what they
find. Number exercises go through `check_number`: the learner's number against labkit's
formula, with the likely wrong answers (`Mistake`s: a forgotten factor, bits for bytes, GB for
bytes, percent for a fraction) named when the number matches one of them.
"""
import math
from dataclasses import dataclass


@dataclass
class Check:
    """What a checker found: `ok`, a short `problem` ("" when ok) and the `message` it printed."""
    ok: bool
    problem: str
    message: str

    def __bool__(self):
        return self.ok

    def __repr__(self):
        return self.message

    def _repr_pretty_(self, printer, cycle):
        printer.text(self.message)


def say(check, verbose=True):
    """Print the check's message (what the learner reads) and return the check."""
    if verbose:
        print(check.message)
    return check


@dataclass
class Mistake:
    """A likely wrong answer: the `value` it gives, a one-word `problem`, and `why` in words."""
    value: float
    problem: str
    why: str


def _unit_mistakes(expected, unit):
    """Wrong answers any number in `unit` invites: bits, a wrong prefix, a percent."""
    if unit == "bytes":
        return [Mistake(8 * expected, "bits", "that is bits; a byte is 8 bits, give bytes"),
                Mistake(expected / 1e9, "units", "the right number in GB; give it in bytes "
                                                 "(1 GB = 1e9 bytes)"),
                Mistake(expected / 1e6, "units", "the right number in MB; give it in bytes "
                                                 "(1 MB = 1e6 bytes)")]
    if unit == "GB":
        return [Mistake(expected * 1e9, "units", "that is bytes; give GB (1 GB = 1e9 bytes)"),
                Mistake(expected * 8, "bits", "that is gigabits; a byte is 8 bits"),
                Mistake(expected * 1e9 / 2 ** 30, "units",
                        "that is GiB (2^30 bytes); give GB (1e9 bytes)")]
    if unit == "fraction":
        return [Mistake(expected * 100, "percent", "that is a percentage; give a fraction "
                                                   "between 0 and 1")]
    return []


def _factor(value, expected):
    """'x2 too large' / 'x3 too small', in words a learner can act on."""
    if expected == 0 or value == 0:
        return "wrong"
    ratio = value / expected
    if abs(ratio - 1) < 0.05:          # a count off by a little: say by how much
        return f"off by {value - expected:+,.3g}"
    big = ratio if ratio >= 1 else 1 / ratio
    text = f"{big:.3g}" if abs(big - round(big)) > 0.01 else f"{round(big):,}"
    return f"too {'large' if ratio >= 1 else 'small'} by a factor {text}"


def _format(value, unit):
    if unit == "fraction":
        return f"{value:.3g}"
    if unit in ("bytes", "tokens", "GPUs") or float(value).is_integer():
        return f"{value:,.0f} {unit}".strip()
    return f"{value:.4g} {unit}".strip()


def check_number(answer, expected, *, what, hint, unit="", mistakes=(), exact=False,
                 tolerance=0.01, explain="", verbose=True):
    """Say in words whether `answer` is `expected` (labkit's formula); never raises.

    `what` names the quantity, `hint` says how to derive it (shown when the answer is missing
    or wrong), `mistakes` are the likely wrong answers to diagnose (with the unit's own:
    bits, GB, percent). `exact` for counts (GPUs, tokens); otherwise within `tolerance`.
    """
    if answer is None or answer is Ellipsis:
        return say(Check(False, "no answer", f"No answer yet for {what}. Hint: {hint}"),
                   verbose)
    try:
        value = float(answer)
    except (TypeError, ValueError):
        return say(Check(False, "not a number", f"Give {what} as a number"
                         f"{' in ' + unit if unit else ''}, not {answer!r}."), verbose)
    if math.isnan(value):
        return say(Check(False, "not a number", f"{what}: nan is not an answer."), verbose)

    def close(x):
        return value == x if exact else abs(value - x) <= tolerance * abs(x)

    if close(expected):
        return say(Check(True, "", f"Correct: {what}: {_format(expected, unit)}."
                         + (f" {explain}" if explain else "")), verbose)
    for mistake in list(mistakes) + _unit_mistakes(expected, unit):
        if mistake.value != expected and close(mistake.value):
            return say(Check(False, mistake.problem, (
                f"Not quite: {_format(value, unit)} is {_factor(value, expected)}: "
                f"{mistake.why}" + ("" if mistake.why[-1] in ".?!" else "."))), verbose)
    side = "more" if value > expected else "less"
    return say(Check(False, "wrong value", (
        f"Not quite: {_format(value, unit)} is {side} than expected for {what}. Hint: {hint}")),
        verbose)
