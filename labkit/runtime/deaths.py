"""Why a launch failed, in words: what each rank was doing, the likely cause, what it said.

A rank that raises sends back its traceback; a rank killed by a signal sends nothing. What the
launch still knows then: the collective each rank was in and how many it had made (the shared
status board, written by `Context.set_status` as "count|text|last"), how low available memory went
while the ranks ran (`MemoryWatch`), and the end of the rank's own stderr (`StderrTail`):
gloo's abort message ("Received data size doesn't match expected size. Is there a distributed
collective mismatch in your code?") goes only there, never to a notebook cell.

A death is named before its consequences: a survivor's "connection closed" (gloo's word for a
peer that died) can reach the launch before the death does (`killed_rank`). A rank that asks
torch for more memory than the system gives is named "out of memory" with the bytes it asked
for, read from torch's allocator message (`out_of_memory`), in one line.
"""
import os
import re
import signal
import time
import warnings

from .cpus import available_memory

TAIL_BYTES = 4096          # the end of each rank's stderr kept for the error message
LOW_MEMORY_FRACTION = 0.1  # available memory under this share of the total is "near the limit"
LOW_MEMORY_FLOOR = 0.5e9   # ... and never less than this many bytes


class LaunchError(RuntimeError):
    """A rank raised, died, or the run timed out; the message names the rank(s)."""


class StderrTail:
    """A rank's stderr pipe: what arrives is passed on to ours (as before) and its end kept."""

    def __init__(self, conn):
        self.conn, self.fd, self.tail, self.open = conn, conn.fileno(), b"", True

    def read(self):
        try:
            data = os.read(self.fd, 65536)
        except OSError:
            data = b""
        if not data:
            self.open = False
            return
        try:
            os.write(2, data)
        except OSError:
            pass
        self.tail = (self.tail + data)[-TAIL_BYTES:]

    def drain(self):
        """Read what the (dead) rank left in the pipe."""
        while self.open and self.conn.poll(0):
            self.read()

    def last_lines(self, n=4):
        lines = [line.strip() for line in self.tail.decode(errors="replace").splitlines()]
        return [line[:400] for line in lines if line][-n:]

    def close(self):
        self.conn.close()


class MemoryWatch:
    """The lowest available memory seen while the ranks run; warns once when it nears zero."""

    def __init__(self, meminfo="/proc/meminfo"):
        self.meminfo = meminfo
        self.lowest = available_memory(meminfo)
        total = total_memory(meminfo)
        self.limit = None if total is None else max(LOW_MEMORY_FLOOR, LOW_MEMORY_FRACTION * total)
        self.warned = False

    def sample(self, pids):
        available = available_memory(self.meminfo)
        if available is None or self.limit is None:
            return
        self.lowest = available if self.lowest is None else min(self.lowest, available)
        if available < self.limit and not self.warned:
            self.warned = True
            used = sum(resident_bytes(pid) for pid in pids)
            warnings.warn(
                f"the {len(pids)} ranks use {used / 1e9:.1f} GB and only {available / 1e9:.1f} "
                f"GB is left available: the system may kill a rank (signal 9). Use fewer ranks "
                f"or a smaller model.", RuntimeWarning, stacklevel=5)  # at the caller of launch

    def was_low(self):
        return self.lowest is not None and self.limit is not None and self.lowest < self.limit


def total_memory(meminfo="/proc/meminfo"):
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_bytes(pid):
    """A process's resident memory (Linux /proc; 0 where unknown)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# what gloo says when a peer's socket closes under a collective (the peer died or left)
LOST_PEER = re.compile(r"connection (closed|reset)|broken pipe|peer|socket closed|"
                       r"end of file|read error|write error", re.IGNORECASE)
# torch's CPU allocator when the system refuses an allocation
ASKED_BYTES = re.compile(r"you tried to allocate (\d+) bytes")


def lost_peer(text):
    """True when a rank's error reads like a lost peer (gloo's consequence of a death)."""
    return bool(LOST_PEER.search(text or ""))


def out_of_memory(text):
    """One line, "ran out of memory: it asked for 1.3 TB ..." from torch's allocator message
    in `text` (a traceback or an error), or None when it is not one."""
    found = ASKED_BYTES.search(text or "")
    if not found:
        return None
    asked = int(found.group(1))
    return (f"ran out of memory: it asked for {asked:,} bytes ({_size(asked)}) in one "
            f"allocation and the system refused; use a smaller shape or batch")


def _size(n):
    return f"{n / 1e12:.3g} TB" if n >= 1e12 else f"{n / 1e9:.3g} GB"


def killed_rank(children, raised, body, grace_s):
    """A rank killed by a signal, if any, when `raised` sent back an error.

    A rank's death closes its sockets before the system shows it dead, so a survivor's
    "connection closed" can arrive first. When the error reads like a lost peer, wait up to
    `grace_s` for one of the others to show a death by signal: that is the cause."""
    lost_peer = LOST_PEER.search(body or "")
    end = time.monotonic() + (grace_s if lost_peer else 0.0)
    while True:
        others = [c for c in children if c is not raised and not c.done]
        codes = [c.process.exitcode for c in others]
        for c, code in zip(others, codes):
            if code is not None and code < 0:
                return c
        # every other rank has handed back its result or left by itself: no death to wait for
        if time.monotonic() >= end or all(code is not None for code in codes):
            return None
        time.sleep(0.01)


def read_board(status, rank, width):
    """(collectives the rank has made or None, the op it is in or "", the last op it was in)
    from the status board."""
    raw = bytes(status[rank * width:(rank + 1) * width]).split(b"\0", 1)[0].decode(
        errors="replace")
    count, sep, rest = raw.partition("|")
    if not sep or not count.isdigit():
        return None, raw, ""
    text, _, last = rest.partition("|")
    return int(count), text, last


def op_name(text):
    return text.removeprefix("waiting in async ").split(" ", 1)[0]


def mismatch(states, finished):
    """A sentence naming mismatched collectives, or None.

    states: {rank: (count, text)} of ranks still running (or the dead one); finished: {rank:
    count} of ranks whose fn returned. Named: two ranks of one group in different ops (or in
    the same op with different sizes), or a rank in a collective past the count at which the
    finished ranks stopped.
    """
    calls = {r: _parse(text) for r, (_, text) in states.items()}
    calls = {r: call for r, call in calls.items() if call is not None}
    ops, sizes = {}, {}
    for a in sorted(calls):
        for b in sorted(calls):
            (op_a, group_a, bytes_a), (op_b, group_b, bytes_b) = calls[a], calls[b]
            if a >= b or b not in group_a or a not in group_b:
                continue
            if op_a != op_b:
                ops.setdefault(op_a, set()).add(a)
                ops.setdefault(op_b, set()).add(b)
            elif group_a == group_b and bytes_a != bytes_b:
                sizes.setdefault(bytes_a, set()).add(a)
                sizes.setdefault(bytes_b, set()).add(b)
    if ops:
        where = "; ".join(f"{_ranks_word(sorted(rs))} in {op}" for op, rs in ops.items())
        return (f"Mismatched collectives: {where}. Every rank must call the same collectives "
                f"in the same order.")
    if sizes:
        where = "; ".join(f"{_ranks_word(sorted(rs))} with {n} bytes" for n, rs in sizes.items())
        return (f"Mismatched sizes in one collective: {where}. Every rank must pass a tensor "
                f"of the same size.")
    for r, (op, group, _) in sorted(calls.items()):   # waits for ranks that have left
        gone = sorted(set(group) & set(finished))
        if not gone:
            continue
        counts = [finished[g] for g in gone if finished[g] is not None]
        n = states[r][0]
        more = ("one collective more than the others" if counts and n == max(counts) + 1
                else "a collective the others never make")
        after = (f" after {max(counts)} collective{'s' if max(counts) != 1 else ''}"
                 if counts else "")
        return (f"Rank {r} makes {more}: it is in its collective #{n} ({op}) but "
                f"{_ranks_word(gone)} of its group finished{after}. Every rank must call the "
                f"same collectives in the same order.")
    return None


def _parse(text):
    """(op, group ranks, bytes) from a status like "all_reduce (group [0, 1], 16 bytes) tag"."""
    found = re.match(r"(\w+) \(group \[([\d, ]*)\], (\d+) bytes\)", text)
    if not found:
        return None
    group = tuple(int(r) for r in found.group(2).split(",") if r.strip())
    return found.group(1), group, int(found.group(3))


def likely_cause(code, op, memory):
    """What a death by signal `-code` most likely means here."""
    sig = -code
    if sig == signal.SIGKILL:
        if memory is not None and memory.was_low():
            return (f"likely out of memory: available memory fell to "
                    f"{memory.lowest / 1e9:.1f} GB while the ranks ran, and the system's "
                    f"out-of-memory killer ends a process with signal 9. Use a smaller model "
                    f"or fewer ranks.")
        return "killed from outside (signal 9: the out-of-memory killer, or a kill -9)."
    if sig == signal.SIGABRT and op:
        return ("likely mismatched collectives across ranks: gloo aborts a process when the "
                "data it receives does not match the collective it waits in. Every rank must "
                "call the same collectives, with the same sizes, in the same order.")
    if sig == signal.SIGABRT:
        return "aborted (signal 6) by a C++ error inside torch or gloo: its message is below."
    if sig == signal.SIGSEGV:
        return "a crash in native code (signal 11, segmentation fault)."
    return None


def death_message(rank, code, states, finished, tail, memory, last=""):
    """Lines saying that `rank` died, what it and the others were in, why, and what it said.

    last: the last collective the dead rank was in, when it died outside one (gloo may abort
    a rank after that rank's side of a mismatched op returned)."""
    why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    try:
        why += f", {signal.Signals(-code).name}" if code is not None and code < 0 else ""
    except ValueError:
        pass
    lines = [f"rank {rank} died without a result ({why})"]
    count, text = states.get(rank, (None, ""))
    if text:
        lines.append(f"  it was in: {text}")
    elif last:
        lines.append(f"  it was not in a collective; the last it made: {last}")
    else:
        lines.append("  it was not in a collective")
    for r, (_, other) in sorted(states.items()):
        if r != rank and other:
            lines.append(f"  rank {r} was in: {other}")
    cause = likely_cause(code, text or last, memory) if code is not None and code < 0 else None
    named = mismatch({**states, rank: (count, text or last)}, finished)
    if named:
        lines.append(named)
    elif cause:
        lines.append(f"Cause: {cause}")
    said = tail.last_lines() if tail is not None else []
    if said:
        lines.append(f"rank {rank}'s stderr ended with:")
        lines += [f"  {line}" for line in said]
    return "\n".join(lines)


def _ranks_word(ranks):
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"

