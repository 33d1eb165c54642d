"""What `python -m labkit` does with its output: a report that cannot be written, a stdout
that is closed, a trace path that cannot take a file, memory this process could not get.
Each ends in one line on stderr and a non-zero exit code, never in a traceback after a run
(and never in a silent exit 0 with the report lost)."""
import os
import sys


def finish(text, problems=()):
    """Print the report (None: nothing to print), then each problem in one line on stderr;
    exit code 1 if there is any, or if stdout refuses the report (a full disk)."""
    problems = list(problems)
    if text is not None:
        try:
            print(text)
            sys.stdout.flush()
        except OSError as error:
            drop_stdout()
            problems.insert(0, f"the report could not be written to stdout "
                               f"({error.strerror or error})")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def stdout_closed():
    """True when there is no stdout at all (`>&-`): Python then sets sys.stdout to None, or
    the descriptor is gone. A stdout that is not a file (a test's capture) is open."""
    if sys.stdout is None or getattr(sys.stdout, "closed", False):
        return True
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def drop_stdout():
    """Discard what stdout still holds, so that the interpreter's own flush at exit does not
    fail again with a traceback: its descriptor now points at the null device."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass


def out_of_memory(error):
    """One line for memory this process could not get (the single-device reference, which runs
    here), with the bytes asked for when torch's allocator says; None for other errors."""
    if isinstance(error, MemoryError):
        return "this process ran out of memory (MemoryError): use a smaller shape or batch"
    if isinstance(error, RuntimeError):
        from .runtime.deaths import out_of_memory
        said = out_of_memory(str(error))
        return f"this process {said}" if said else None
    return None


def check_writable(path, flag):
    """Refuse, before the run, a path the report cannot be written to: a folder, a missing
    folder, a place that refuses files (/proc, read-only). Opening for append creates nothing
    that was there and changes nothing; a file it created is removed again."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a folder; give a file name, e.g. "
                         f"{os.path.join(path, 'trace.json')}")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: its folder does not exist")
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot be written ({error.strerror or error})") \
            from None
    if not existed:
        os.remove(path)
