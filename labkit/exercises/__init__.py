"""Exercise checkers: each runs a learner's code (or reads their number) and answers with a
`Check`: ok or not, a one-word problem, and advice in plain words."""
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
