"""Reading a file a user names (a --trace, a --gpu-profile) without a traceback or a hang.

A user's path may be a folder, a FIFO with no writer (open(2) would block forever), a device, a
huge file or not UTF-8; each is refused before anything parses it, in one line that names the
flag and the file (`where`) and says what is wrong; so is JSON that does not parse.
"""
import json
import os
import stat


def read_user_text(path, where, max_bytes, kind):
    """The text of the regular file `path`, at most `max_bytes` of UTF-8; anything else: one-line
    ValueError starting with `where`. `kind` names what the file should be ("a trace is UTF-8
    CSV or JSON"), for the message."""
    try:
        with open(path, "rb", opener=_open_nonblocking) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{where}: not a regular file (a folder, FIFO or device); "
                                 f"{kind}")
            raw = f.read(max_bytes + 1)
    except OSError as error:
        raise ValueError(f"{where}: cannot read it ({error.strerror or error})") from None
    if len(raw) > max_bytes:
        size = f"{max_bytes >> 20} MiB" if max_bytes >= 1 << 20 else f"{max_bytes >> 10} KiB"
        raise ValueError(f"{where}: larger than {size}; {kind}")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ValueError(f"{where}: not UTF-8 text (byte {error.start}); {kind}") from None


def parse_user_json(text, where, what):
    """`text` parsed as JSON; malformed or nested too deeply (a RecursionError): one-line
    ValueError starting with `where`, naming `what` the file should be."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error.msg}, line {error.lineno})") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to be {what}") from None


def _open_nonblocking(path, flags):
    """open(2) that cannot block on a FIFO with no writer (the regular-file check follows)."""
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
