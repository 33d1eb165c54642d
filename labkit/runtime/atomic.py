"""Every file labkit writes is written whole or not at all: the text goes to a temporary file
in the same folder, which is flushed to disk and then renamed over the target (`os.replace`,
atomic on POSIX and Windows within one file system). A full disk, a kill or an error half way
leaves the old file (or none), never half of one; a reader never sees a partial JSON.

A target that is not a regular file (/dev/null, /dev/full, a FIFO, a terminal) cannot be
replaced by a rename without destroying it, so it is written in place; a symbolic link is
followed, so the file it points at is replaced and the link stays. Plain Python: no torch.
"""
import json
import os
import stat
import tempfile


def write_text(path, text, encoding="utf-8"):
    """Write `text` to `path` atomically (see the module docstring); returns `path`. An
    OSError (no space, no permission, no folder) propagates with nothing left behind."""
    data = text.encode(encoding) if isinstance(text, str) else bytes(text)
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with open(target, "wb") as f:   # a device or a pipe: nothing to rename over
            f.write(data)
        return path
    folder = os.path.dirname(target) or "."
    fd, temp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.",
                                suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file 0600: give it the old file's mode, or a new file's usual one
        os.chmod(temp, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
        os.replace(temp, target)
    except BaseException:
        try:
            os.remove(temp)
        except OSError:
            pass
        raise
    return path


def write_json(path, value, **dump_options):
    """`json.dumps(value, **dump_options)` written atomically to `path` (the text is made
    first, so a value that cannot be serialised leaves the old file as it was)."""
    return write_text(path, json.dumps(value, **dump_options))


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
