"""Exercise checkers: each runs a learner's code (or reads their number) and answers with a
`Check`: ok or not, a short problem, and advice in plain words, printed by `say`.

Code exercises run the learner's function on ranks (`labkit.launch`) and diagnose what they
find, with the lab's own instruments where the values alone cannot tell (right values by a
wasteful method: the comm log's ops and bytes, the FLOPs labkit's counter counts). Number
exercises go through `check_number`: the learner's number against labkit's formula, with the
likely wrong answers (`Mistake`s: a forgotten factor, values for bytes, bits for bytes, GB for
bytes, percent for a fraction) named when the number matches one of them, and every one of
them named when several mistakes give the same number (`Check.problems`); answers that differ
only by a reasonable rounding of an input (`Rounding`) are accepted, and the message says so.

Every exercise hints before it tells (`Hints`, one per exercise, counting the misses in the
learner's kernel): the first wrong answer gets a conceptual hint, the code or the formula only
from the second on, or when the learner asks (`show_solution(n)` in each lesson's module).
A checker never raises on what a learner may hand in (None, a string, a tensor of the wrong
shape or dtype, a detached tensor, something that is not a function): it answers in one line.
"""
import math
from dataclasses import dataclass


@dataclass
class Check:
    """What a checker found: `ok`, a short `problem` ("" when ok) and the `message` it printed;
    `problems` names every mistake that gives the learner's number (`problem` is the first)."""
    ok: bool
    problem: str
    message: str
    problems: tuple = ()

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
    """A likely wrong answer: the `value` it gives, a short `problem` tag, `why` in words, and
    its own `name` where several mistakes share a tag (the tag otherwise)."""
    value: float
    problem: str
    why: str
    name: str = ""


@dataclass
class Rounding:
    """An answer computed from rounded inputs: its `value`, and `how` the inputs were rounded."""
    value: float
    how: str


class Hints:
    """One exercise's hints: `concept` after the first wrong answer, `code` after later ones.

    The count lives in the learner's kernel (one object per exercise); `show()` prints the code
    (or formula) at any time, what the lesson's `show_solution(exercise)` calls; `reset()`
    starts over. `code` may be a function returning the text (a formula with the catalog's
    numbers, computed when first needed). `kind` names what the second hint shows."""

    def __init__(self, concept, code, exercise=1, kind="code"):
        self.concept, self._code, self.failures = concept, code, 0
        self.exercise, self.kind = exercise, kind
        _ALL_HINTS.append(self)

    @property
    def code(self):
        return self._code() if callable(self._code) else self._code

    def after_failure(self):
        """The hint for this wrong answer: conceptual first, then the code."""
        self.failures += 1
        if self.failures == 1:
            call = "show_solution()" if self.exercise == 1 else \
                f"show_solution({self.exercise})"
            return (f"Hint: {self.concept} (Stuck? A second try, or {call}, shows the "
                    f"{self.kind}.)")
        return f"The {self.kind}: {self.code}"

    def show(self):
        print(self.code)

    def reset(self):
        self.failures = 0


_ALL_HINTS = []


def reset_hints():
    """Forget every exercise's wrong answers (a fresh kernel's state; tests use it)."""
    for hints in _ALL_HINTS:
        hints.reset()


def show(hints_by_exercise, exercise):
    """Print one exercise's code or formula (a lesson's `show_solution(exercise)`)."""
    if exercise not in hints_by_exercise:
        print(f"No exercise {exercise!r} here: exercises {sorted(hints_by_exercise)}.")
        return
    hints_by_exercise[exercise].show()


def with_hint(check, hints):
    """A failed check gets the exercise's next hint (the concept first, later the code); one
    that says nothing about the answer (not written, not a function, a busy machine) does not."""
    if not check.ok and check.problem not in ("not written", "no answer", "not answered",
                                              "not a function", "slow"):
        check.message = check.message.rstrip() + " " + hints.after_failure()
    return check


def not_a_function(fn, args):
    """A Check when the learner handed in something other than a function (None, a number),
    else None: the checker answers in one line instead of failing on every rank."""
    if callable(fn):
        return None
    return Check(False, "not a function", f"Give your function itself, {args}, not "
                 f"{type(fn).__name__} (write it in the cell above, then pass its name).")


def too_slow_to_start(error_text):
    """A launch time-out before any rank reached a collective: a busy machine, not the code."""
    return "timed out" in error_text and "no rank waits in a collective" in error_text


SLOW = ("TIMED OUT before any rank reached a collective: the machine is busy, your code is not "
        "to blame yet; run the check again with timeout_s=60.")


NO_MESH = ("THE RANKS COULD NOT CONNECT (gloo's connectFullMesh failed, on a busy machine) "
           "before your code ran: it is not to blame; run the check again.")


def not_started(error_text):
    """SLOW or NO_MESH when the ranks never got to run the learner's code, else None."""
    if too_slow_to_start(error_text):
        return SLOW
    return NO_MESH if "connectFullMesh" in error_text else None


def ranks_waiting_in(timeout_text):
    """{rank: the op it waits in ('send', 'recv', 'all_reduce', ...)} from a launch time-out."""
    where = {}
    for line in timeout_text.splitlines():
        head, _, status = line.strip().partition(": ")
        if head.startswith("rank ") and head[5:].isdigit() and status:
            words = status.removeprefix("waiting in ").removeprefix("async ").split()
            where[int(head[5:])] = words[0] if words else "?"
    return where


def deadlock_in_words(timeout_text):
    """Why point-to-point ranks hang, from the op they wait in (a blocking send or a recv)."""
    ops = set(ranks_waiting_in(timeout_text).values())
    if not ops:
        return ("No rank had reached a send or recv yet (still starting or computing): on a "
                "busy machine give it more time (timeout_s=30).")
    if ops == {"send"}:
        return ("Every rank waits in send: a blocking send returns only once the neighbour "
                "has received, and the neighbour is itself stuck in its own send, so nobody "
                "reaches recv.")
    if ops == {"recv"}:
        return ("Every rank waits in recv: each waits for a message that nobody sends, since "
                "every rank receives before it sends.")
    if ops <= {"send", "recv"} and ops:
        return ("Ranks wait in send and in recv at once: a blocking send waits for a recv that "
                "its neighbour has not reached, in a cycle.")
    return "The ranks wait for each other in a cycle."


def _unit_mistakes(expected, unit):
    """Wrong answers any number in `unit` invites: bits, a wrong prefix, a percent."""
    if unit == "bytes":
        return [Mistake(8 * expected, "bits", "that is bits; a byte is 8 bits, give bytes"),
                Mistake(expected / 1e9, "units", "the right number in GB; give it in bytes "
                                                 "(1 GB = 1e9 bytes)", "GB, not bytes"),
                Mistake(expected / 1e6, "units", "the right number in MB; give it in bytes "
                                                 "(1 MB = 1e6 bytes)", "MB, not bytes")]
    if unit == "GB":
        return [Mistake(expected * 1e9, "units", "that is bytes; give GB (1 GB = 1e9 bytes)",
                        "bytes, not GB"),
                Mistake(expected * 8, "bits", "that is gigabits; a byte is 8 bits"),
                Mistake(expected * 1e9 / 2 ** 30, "units",
                        "that is GiB (2^30 bytes); give GB (1e9 bytes)", "GiB")]
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
    """The learner's number as they wrote it (234.375 stays 234.375, never rounded to 234)."""
    if unit == "fraction":
        return f"{value:.4g}"
    if float(value).is_integer():
        return f"{value:,.0f} {unit}".strip()
    if unit in ("bytes", "tokens", "GPUs") and abs(value) >= 1e6:
        return f"{value:,.1f} {unit}".strip()
    return f"{value:.7g} {unit}".strip()


def _answer_value(answer):
    """The learner's number as a float, or None: a one-element tensor or array counts."""
    if isinstance(answer, bool):
        return None
    try:
        if hasattr(answer, "numel") and answer.numel() == 1:
            answer = answer.item()
        elif hasattr(answer, "size") and getattr(answer, "size", 0) == 1 and \
                hasattr(answer, "item"):
            answer = answer.item()
        return float(answer)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None


def check_number(answer, expected, *, what, hints, unit="", mistakes=(), exact=False,
                 tolerance=0.01, explain="", roundings=(), verbose=True):
    """Say in words whether `answer` is `expected` (labkit's formula); never raises.

    `what` names the quantity; `hints` (a `Hints`) gives the concept after the first miss and
    the formula after later ones (or on `show_solution`). `mistakes` are the likely wrong
    answers to diagnose (with the unit's own: bits, GB, percent); where several give the
    learner's number, the message names each of them. `exact` for counts (GPUs, tokens);
    otherwise within `tolerance`. `roundings` (`Rounding`s) are answers from reasonably
    rounded inputs: accepted, and said.
    """
    if answer is None or answer is Ellipsis:
        return say(Check(False, "no answer", f"No answer yet for {what}. Hint: "
                         f"{hints.concept}"), verbose)
    value = _answer_value(answer)
    if value is None:
        shown = repr(answer)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        return say(Check(False, "not a number", f"Give {what} as one number"
                         f"{' in ' + unit if unit else ''}, not {shown}."), verbose)
    if math.isnan(value) or math.isinf(value):
        return say(Check(False, "not a number", f"{what}: {value} is not an answer."), verbose)

    def close(x):
        return value == x if exact else abs(value - x) <= tolerance * abs(x)

    if close(expected):
        return say(Check(True, "", f"Correct: {what}: {_format(expected, unit)}."
                         + (f" {explain}" if explain else "")), verbose)
    for rounding in roundings:
        if close(rounding.value):
            return say(Check(True, "", f"Correct: {what}: {_format(value, unit)}, accepted: "
                             f"{rounding.how}; unrounded it is {_format(expected, unit)}."
                             + (f" {explain}" if explain else "")), verbose)
    found, names = [], []
    for mistake in list(mistakes) + _unit_mistakes(expected, unit):
        if mistake.value == expected or not close(mistake.value):
            continue
        if (mistake.name or mistake.problem) not in names:
            found.append(mistake)
            names.append(mistake.name or mistake.problem)
    if found:
        whys = [m.why + ("" if m.why[-1] in ".?!" else ".") for m in found]
        said = whys[0] if len(whys) == 1 else (
            f"{len(whys)} different mistakes give this number: "
            + " ".join(f"({i}) {w}" for i, w in enumerate(whys, 1)))
        return say(Check(False, found[0].problem, (
            f"Not quite: {_format(value, unit)} is {_factor(value, expected)}: {said} "
            f"{hints.after_failure()}"), tuple(names)), verbose)
    side = "more" if value > expected else "less"
    return say(Check(False, "wrong value", (
        f"Not quite: {_format(value, unit)} is {side} than expected for {what}. "
        f"{hints.after_failure()}")), verbose)
