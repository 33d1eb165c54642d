"""Lesson 01's exercise: a ring all-reduce from send and recv, checked on 4 ranks.

`check_ring_all_reduce(fn)` runs the learner's `fn(ctx, tensor)` on every rank with different
data and says in words what is wrong: a wrong sum, chunks in the wrong place, a deadlock (named
by the op the ranks wait in: every rank in a blocking send, or in recv), another collective
used, or more bytes sent than the ring's 2(N-1)/N x S.
`check_ring_bytes(answer)` checks the bytes each GPU sends to all-reduce GPT-2 small's bf16
gradients on 8 GPUs against `theory.data_parallel.ring_all_reduce_bytes`.
"""
import torch

from ..runtime.launch import LaunchError, launch
from ..theory import catalog
from ..theory.data_parallel import ring_all_reduce_bytes
from . import (Check, Hints, Mistake, check_number, deadlock_in_words, not_a_function, not_started,
               say, show, with_hint)


def _ring_input(rank, numel):
    """Distinct, exactly summable values per rank (small integers: no float rounding)."""
    return torch.arange(numel, dtype=torch.float32) + 100.0 * (rank + 1)


def _run_user_ring(ctx, user_fn, numel):
    tensor = _ring_input(ctx.rank, numel)
    original = tensor.clone()
    out = user_fn(ctx, tensor)
    got = out if isinstance(out, torch.Tensor) else tensor
    sent = sum(rec.bytes for rec in ctx.comm.records if rec.op == "send")
    others = sorted({rec.op for rec in ctx.comm.records if rec.op not in ("send", "recv")})
    return dict(rank=ctx.rank, got=got.detach().reshape(-1).to(torch.float32, copy=True),
                input=original, sent_bytes=sent, other_ops=others)


def check_ring_all_reduce(user_fn, world_size=4, numel=16, timeout_s=20.0, verbose=True):
    """Run `user_fn(ctx, tensor)` on `world_size` ranks and say, in words, whether it all-reduces.

    Every rank hands in a different float32 tensor of `numel` elements; the sum over ranks is
    expected back (returned, or written into `tensor`). Returns a `Check` (and prints it).
    """
    n = world_size
    if (refused := not_a_function(user_fn, "user_fn(ctx, tensor)")) is not None:
        return say(refused, verbose)
    try:
        results = launch(_run_user_ring, n, user_fn, numel, timeout_s=timeout_s)
    except LaunchError as error:
        return say(with_hint(_failed_run(str(error), timeout_s), RING_HINTS), verbose)
    expected = sum(_ring_input(r, numel) for r in range(n))
    bad = [res for res in results if not torch.equal(res["got"], expected)]
    if bad:
        return say(with_hint(_diagnose(bad[0], expected, n), RING_HINTS), verbose)
    limit = ring_all_reduce_bytes(numel * 4, n)
    worst = max(results, key=lambda res: res["sent_bytes"])
    cheat = sorted({op for res in results for op in res["other_ops"]})
    if cheat:
        check = Check(False, "not a ring", (
            f"The sums are right, but you called {', '.join(cheat)}: build the ring from "
            "ctx.comm.send and ctx.comm.recv only."))
    elif worst["sent_bytes"] > limit + 1e-9:
        check = Check(False, "too many bytes", (
            f"The sums are right, but rank {worst['rank']} sent {worst['sent_bytes']} bytes; "
            f"a ring all-reduce sends 2(N-1)/N x S = 2x{n - 1}/{n} x {numel * 4} = "
            f"{limit:.0f} bytes per rank. Send one chunk (S/N) per step, N-1 steps per "
            "phase, not the whole tensor."))
    else:
        check = Check(True, "", (
            f"Correct: all {n} ranks hold the sum, and each rank sent "
            f"{worst['sent_bytes']} bytes = 2(N-1)/N x S = 2x{n - 1}/{n} x {numel * 4} "
            "bytes, the least any all-reduce can send."))
    return say(with_hint(check, RING_HINTS), verbose)


RING_HINTS = Hints(
    concept="cut the tensor into N chunks; in a first phase each chunk travels round the ring "
            "collecting the sum (N-1 steps, one chunk sent and one received per step), in a "
            "second phase the finished chunks travel round once more (N-1 steps, copying).",
    code="chunks = list(tensor.chunk(n)); for step in range(n - 1): send chunks[(r - step) % n] "
         "to (r + 1) % n (async_op=True), recv into a buffer from (r - 1) % n, wait, and add it "
         "into chunks[(r - step - 1) % n]; then for step in range(n - 1): send chunks[(r + 1 - "
         "step) % n], recv and copy into chunks[(r - step) % n]; return torch.cat(chunks).")
BYTES_HINTS = Hints(
    concept="a ring all-reduce is a reduce-scatter followed by an all-gather; in each, a rank "
            "sends every chunk but the one it ends up owning, one chunk of S/N per step.",
    code="2 (N-1)/N x S bytes per rank, S = 2 bytes x the parameters (bf16 gradients).",
    exercise=2, kind="formula")
HINTS = {1: RING_HINTS, 2: BYTES_HINTS}


def show_solution(exercise=1):
    """Print the code (exercise 1) or the formula (exercise 2)."""
    show(HINTS, exercise)


def _failed_run(text, timeout_s):
    if (busy := not_started(text)) is not None:
        return Check(False, "slow", busy)
    if "NotImplementedError" in text:
        return Check(False, "not written", "NOT WRITTEN YET: your function raised "
                     "NotImplementedError. Hint: cut the tensor into N chunks, run N-1 "
                     "reduce-scatter steps to the right neighbour (send one chunk, receive one, "
                     "add it), then N-1 all-gather steps (send, receive, copy).")
    if "timed out" in text:
        waits = "\n".join(line for line in text.splitlines() if line.startswith("  rank"))
        return Check(False, "deadlock", (
            f"Deadlock: the ranks were still waiting after {timeout_s:g} s.\n{waits}\n"
            f"{deadlock_in_words(text)} Post the send without waiting for it (handle = "
            "ctx.comm.send(chunk, right, async_op=True)), then recv from the left, then "
            "handle.wait()."))
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    return Check(False, "error", f"Your function raised an error: {last}\n\n{text}")


def _diagnose(res, expected, n):
    got, rank = res["got"], res["rank"]
    if got.numel() != expected.numel():
        return Check(False, "wrong chunk", (
            f"Rank {rank} handed back {got.numel()} elements, expected {expected.numel()}: "
            "return (or fill in) the whole tensor, not one chunk."))
    want_chunks = list(torch.tensor_split(expected, n))
    got_chunks = list(torch.tensor_split(got, n))
    right = [i for i in range(n) if torch.equal(got_chunks[i], want_chunks[i])]
    wrong = [i for i in range(n) if i not in right]
    show = f"rank {rank}: expected {_short(expected)}\n        got      {_short(got)}"
    if torch.equal(got, res["input"]):
        return Check(False, "wrong sum", (
            f"Nothing was reduced: rank {rank} still holds its own input.\n{show}\n"
            "Add what you receive into your chunk (chunk += incoming) and write the result back "
            "into the tensor you were given (or return it)."))
    if torch.equal(got, res["input"] * n):
        return Check(False, "same data", (
            f"Rank {rank} multiplied its own tensor by N = {n}, as if every rank held the same "
            f"data; they differ, so the sum must be built from what the others send.\n{show}"))
    if torch.allclose(got * n, expected):
        return Check(False, "wrong sum", (
            f"You averaged instead of summing (got = sum / {n}).\n{show}"))
    placed = all(any(torch.equal(g, w) for w in want_chunks) for g in got_chunks)
    if placed and wrong:
        return Check(False, "wrong chunk", (
            f"Every chunk on rank {rank} is a correct sum, but in the wrong place: chunks "
            f"{wrong} hold another chunk's values.\n{show}\n"
            "Check the indices: in reduce-scatter step s rank r sends chunk (r - s) mod N and "
            "receives chunk (r - s - 1) mod N; in all-gather step s it sends (r + 1 - s) mod N "
            "and receives (r - s) mod N."))
    if right:
        return Check(False, "wrong chunk", (
            f"Rank {rank} has chunks {right} right and chunks {wrong} wrong.\n{show}\n"
            "Each chunk must travel the whole ring: N-1 reduce-scatter steps (adding) and then "
            "N-1 all-gather steps (copying the finished chunk). A chunk that stops early holds "
            "a partial sum or stale values."))
    return Check(False, "wrong sum", (
        f"Wrong sum on rank {rank}.\n{show}\n"
        "In reduce-scatter add the received chunk into yours; in all-gather copy it over yours."))


def _short(t, k=8):
    values = ", ".join(f"{v:g}" for v in t[:k].tolist())
    return f"[{values}{', ...' if t.numel() > k else ''}]"


RING_BYTES_MODEL, RING_BYTES_GPUS = "gpt2-small", 16


def check_ring_bytes(answer, model=RING_BYTES_MODEL, world_size=RING_BYTES_GPUS, verbose=True):
    """Bytes each GPU sends in one ring all-reduce of the model's bf16 gradients."""
    n, size = world_size, 2 * catalog.model(model).param_count()   # S: bf16 gradient bytes
    expected = ring_all_reduce_bytes(size, n)
    mistakes = [
        Mistake(2 * size, "factor (N-1)/N", f"that is 2 x S: each phase moves (N-1)/N x S per "
                f"rank, not S (a rank never sends the chunk it ends up owning); x {n - 1}/{n}"),
        Mistake(2 * (n - 1) * size, "whole tensor", f"that sends the whole S in each of the "
                f"2(N-1) steps; each step sends one chunk of S/N = S/{n}"),
        Mistake(2 * expected, "fp32", "that counts 4 bytes per gradient; they are bf16, 2 "
                "bytes each"),
        Mistake(size, "just S", "that is the gradient itself, S, not what the ring sends"),
        Mistake(expected / 2, "values, not bytes", "that counts values (gradients), not "
                "bytes: each bf16 value is 2 bytes"),
        Mistake(2 * (n - 1) / n * size / 2, "one phase", "off by a factor 2: a ring "
                "all-reduce sends each byte twice, once in reduce-scatter and once in "
                "all-gather"),
    ]
    return check_number(answer, expected, what=f"bytes each of {n} GPUs sends to all-reduce "
                        f"{catalog.model(model).display_name}'s bf16 gradients", unit="bytes",
                        mistakes=mistakes, verbose=verbose, hints=BYTES_HINTS,
                        explain="It stays under 2 S however many GPUs join.")
