"""Lesson 08's exercise: merge two partial attention results by their log-sum-exp.

The learner writes `merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`: the attention of the same
queries over the keys of block a and block b together, from each block's own softmax output and
log-sum-exp (what ring attention does after every ring step). The checker runs it on cases
built from real attention (ordinary scores, scores large enough to overflow exp, and a query
that has seen no key at all yet, as a causal mask makes) and says what is wrong in plain words.
No ranks are needed: the merge is arithmetic on one device. The first wrong answer gets a
hint, later ones (or `show_solution()`) the code.

`check_ring_attention(fn)` runs the learner's `fn(ctx, q, k, v)` on 4 ranks, each holding its
contiguous quarter of a sequence, and compares with attention over the whole sequence on one
device (no mask): a rank that attends to its own keys only, a deadlock, a pass too many, or a
wrong merge are said in words. `check_ring_bytes` checks a number: the bytes one rank sends in
the forward ring of one attention layer (`theory.context_parallel.comm_bytes_per_rank`).
"""
import math

import torch

from ..theory import context_parallel as tcp
from . import (Check, Hints, Mistake, check_number, deadlock_in_words, not_a_function, not_started,
               say, show, with_hint)


def partial_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d)) v over these keys only, and each query's log-sum-exp."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v   # a key-less row: zeros
    return out, lse


def _case(kind):
    """(the two partial results, the full attention's out and lse) for one kind of case."""
    g = torch.Generator().manual_seed({"plain": 0, "large": 1, "masked": 2}[kind])
    q, k, v = (torch.randn(2, 6, 8, generator=g) for _ in range(3))
    if kind == "large":   # scores of a few hundred: exp() of them overflows float32
        q, k = q * 12, k * 12
    mask_a = mask_b = None
    if kind == "masked":  # query 0 sees no key of either block yet (a causal mask does this)
        mask_a = torch.ones(6, 3, dtype=torch.bool)
        mask_a[0] = False
        mask_b = torch.ones(6, 3, dtype=torch.bool)
        mask_b[:2] = False
    ka, kb, va, vb = k[:, :3], k[:, 3:], v[:, :3], v[:, 3:]
    out_a, lse_a = partial_attention(q, ka, va, mask_a)
    out_b, lse_b = partial_attention(q, kb, vb, mask_b)
    full_mask = None if mask_b is None else torch.cat([mask_a, mask_b], dim=1)
    out, lse = partial_attention(q, k, v, full_mask)   # query 0: out 0, lse -inf
    return (out_a, lse_a, out_b, lse_b), (out, lse)


def _run(fn, kind):
    args, (out, lse) = _case(kind)
    try:
        got = fn(*(t.clone() for t in args))
    except Exception as error:  # noqa: BLE001 - the learner's code: report, never crash
        return "error", f"{type(error).__name__}: {error}"
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        return "shape", "return a pair (out, lse) of tensors"
    got_out, got_lse = got
    if got_out.shape != out.shape or got_lse.shape != lse.shape:
        return "shape", (f"out should be {tuple(out.shape)} and lse {tuple(lse.shape)}, got "
                         f"{tuple(got_out.shape)} and {tuple(got_lse.shape)}")
    if not (got_out.is_floating_point() and got_lse.is_floating_point()):
        return "shape", (f"out and lse should be floating point, got {got_out.dtype} and "
                         f"{got_lse.dtype}")
    got_out, got_lse = got_out.detach().float(), got_lse.detach().float()
    if got_out.isnan().any() or got_lse.isnan().any() or (got_out.isinf().any()):
        return "nonfinite", ""
    if not torch.allclose(got_out, out, atol=1e-5, rtol=1e-4):
        return "out", (got_out - out).abs().max().item()
    if not torch.allclose(got_lse, lse, atol=1e-4, rtol=1e-5):
        return "lse", (got_lse - lse).abs().max().item()
    return "ok", ""


MERGE_HINTS = Hints(
    concept="each block's output is normalised by its own softmax sum, exp(lse); the merged "
            "output weighs each block by its share of the total sum, and the merged lse is the "
            "log of the total. Never exponentiate an lse itself (it may overflow), and a block "
            "no query has seen (lse = -inf) has weight 0.",
    code="lse = torch.logaddexp(lse_a, lse_b); w_a = torch.exp(lse_a - lse).nan_to_num(0.0); "
         "w_b = torch.exp(lse_b - lse).nan_to_num(0.0); out = w_a[..., None] * out_a + "
         "w_b[..., None] * out_b; return out, lse")


RING_HINTS = Hints(
    concept="a rank starts with its own K, V block; the other N-1 blocks come to it one ring "
            "step at a time from its left neighbour while it passes what it has to the right, "
            "and each block that arrives is merged into the result by its log-sum-exp; a rank "
            "never holds more than the block it computes on and the one in flight.",
    code="out, lse = partial_attention(q, k, v); for _ in range(N - 1): sends = "
         "[ctx.comm.send(t, (r + 1) % N, async_op=True) for t in (k, v)]; k_in, v_in = "
         "torch.empty_like(k), torch.empty_like(v); ctx.comm.recv(k_in, (r - 1) % N); "
         "ctx.comm.recv(v_in, (r - 1) % N); [h.wait() for h in sends]; k, v = k_in, v_in; "
         "out, lse = merge(out, lse, *partial_attention(q, k, v)); return out", exercise=2)
BYTES_HINTS = Hints(
    concept="count the bytes of one rank's K and V block (only the KV heads exist, bf16), and "
            "how many blocks a rank must pass on for every rank to see every block.",
    code="(N-1) x KV, KV = 2 (K and V) x b x h_kv x (s/N) x d x 2 bytes.",
    exercise=3, kind="formula")
HINTS = {1: MERGE_HINTS, 2: RING_HINTS, 3: BYTES_HINTS}


def show_solution(exercise=1):
    """Print the code of exercise 1 (the log-sum-exp merge) or 2 (the ring), or the formula
    of exercise 3."""
    show(HINTS, exercise)


def check_merge(fn, verbose=True):
    """Run the learner's `fn(out_a, lse_a, out_b, lse_b) -> (out, lse)` on three cases; print
    the feedback and return a Check."""
    if (refused := not_a_function(fn, "fn(out_a, lse_a, out_b, lse_b)")) is not None:
        return say(refused, verbose)
    check = _judge(fn)
    check = with_hint(check, MERGE_HINTS)
    return say(check, verbose)


def _judge(fn):
    verdict, detail = _run(fn, "plain")
    if verdict == "error" and detail.startswith("NotImplementedError"):
        return Check(False, "not written", "NOT WRITTEN YET: your function raised "
                     f"NotImplementedError. Hint: {MERGE_HINTS.concept}")
    if verdict == "error":
        return Check(False, "error", f"Your function raised {detail}. out_a and out_b are "
                     "(2, 6, 8) (batch, queries, head_dim); lse_a and lse_b are (2, 6).")
    if verdict == "shape":
        return Check(False, "shape", f"Wrong shapes: {detail}.")
    if verdict == "out":
        args, (out, _) = _case("plain")
        average = (args[0] + args[2]) / 2
        try:
            again = torch.as_tensor(fn(*args)[0]).detach().float()
        except Exception:  # noqa: BLE001 - it ran once already; a second run only names it
            again = None
        if again is not None and again.shape == average.shape and \
                torch.allclose(average, again, atol=1e-5):
            return Check(False, "average", "You averaged the two outputs, as if both blocks "
                         "had the same softmax sum.")
        return Check(False, "wrong", f"The merged output differs from attention over all the "
                     f"keys (max difference {detail:.3g}).")
    if verdict == "lse":
        return Check(False, "lse", f"The output is right but the returned lse is not (max "
                     f"difference {detail:.3g}): the next merge needs the log of the total "
                     "softmax sum of both blocks.")
    if verdict == "nonfinite":
        return Check(False, "nonfinite", "Your result has inf or nan on ordinary scores.")
    verdict, detail = _run(fn, "large")
    if verdict != "ok":
        return Check(False, "overflow", "Right on ordinary scores, but with scores of a few "
                     "hundred exp(lse) overflows float32 (exp(89) is already inf): work with "
                     "differences of lse, whose exp is at most 1.")
    verdict, detail = _run(fn, "masked")
    if verdict != "ok":
        return Check(False, "masked", "Right until a query has seen no key in either block "
                     "(both lse = -inf, as a causal mask makes at the start of ring "
                     "attention): then lse is -inf too and -inf - (-inf) is nan; such a side "
                     "must weigh 0, and out stays 0.")
    return Check(True, "", "Correct: the merge is exact (ordinary scores), stable (scores of a "
                 "few hundred) and handles a query that sees no key of a block. Ring attention "
                 "merges one such block per ring step.")


RING_WORLD, RING_SHAPE = 4, (2, 16, 8)     # ranks; batch, whole sequence, head_dim

def _ring_inputs():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(*RING_SHAPE, generator=g) for _ in range(3)]


def _run_ring_attention(ctx, fn):
    q, k, v = (t.chunk(ctx.world_size, dim=1)[ctx.rank].clone() for t in _ring_inputs())
    out = fn(ctx, q, k, v)
    records = list(ctx.comm.records)
    sent = sum(rec.bytes for rec in records if rec.op == "send")
    return dict(rank=ctx.rank, out=out.detach().clone() if isinstance(out, torch.Tensor)
                else out, sent=sent, kv_bytes=k.nbytes + v.nbytes,
                collectives=sorted({rec.op for rec in records if rec.op not in ("send", "recv")}),
                wire=sum(rec.wire_bytes_per_rank for rec in records if rec.op != "recv"))


def check_ring_attention(fn, timeout_s=20.0, verbose=True):
    """Run `fn(ctx, q, k, v) -> out` (this rank's queries against every rank's keys) on 4 ranks."""
    from ..runtime.launch import LaunchError, launch
    if (refused := not_a_function(fn, "fn(ctx, q, k, v)")) is not None:
        return say(refused, verbose)
    try:
        results = launch(_run_ring_attention, RING_WORLD, fn, timeout_s=timeout_s)
    except LaunchError as error:
        check = _ring_failed(str(error))
    else:
        check = _judge_ring(results)
    check = with_hint(check, RING_HINTS)
    return say(check, verbose)


def _ring_failed(text):
    if (busy := not_started(text)) is not None:
        return Check(False, "slow", busy)
    if "NotImplementedError" in text:
        return Check(False, "not written", "NOT WRITTEN YET: your function (or the merge it "
                     f"calls) raised NotImplementedError. Hint: {RING_HINTS.concept}")
    if "timed out" in text:
        waits = "\n".join(line for line in text.splitlines() if line.startswith("  rank"))
        return Check(False, "deadlock", f"DEADLOCK: the ranks still waited at the timeout:\n"
                     f"{waits}\n{deadlock_in_words(text)} Post the sends with async_op=True "
                     "before the recvs, and wait on their handles after.")
    last = [line for line in text.splitlines() if line.strip()][-1].strip()
    return Check(False, "raised", f"YOUR CODE RAISED on a rank: {last}.")


def _judge_ring(results):
    n = len(results)
    q, k, v = _ring_inputs()
    full, _ = partial_attention(q, k, v)
    for res in results:
        r, out = res["rank"], res["out"]
        want = full.chunk(n, dim=1)[r]
        if not isinstance(out, torch.Tensor) or out.shape != want.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            return Check(False, "shape", f"Rank {r} returned {got}; expected out of shape "
                         f"{tuple(want.shape)} (batch, this rank's queries, head_dim).")
        if not out.is_floating_point():
            return Check(False, "dtype", f"Rank {r} returned dtype {out.dtype}; attention's "
                         "output is floating point.")
        out = out.float()
        if torch.allclose(out, want, atol=1e-5):
            continue
        mine = [t.chunk(n, dim=1)[r] for t in (q, k, v)]
        if torch.allclose(out, partial_attention(*mine)[0], atol=1e-5):
            return Check(False, "no ring", f"Rank {r}'s queries attended only to its own keys: "
                         "the other ranks' K and V blocks never arrived.")
        return Check(False, "wrong", f"Rank {r}'s output differs from attention over the whole "
                     f"sequence by {(out - want).abs().max():.3g}. Is every block merged "
                     "exactly once (your own and N-1 received ones)?")
    used = sorted({op for res in results for op in res["collectives"]})
    if used:
        kv, moved = results[0]["kv_bytes"], max(res["wire"] for res in results)
        same = (f"the ring's (N-1) x KV = {(n - 1) * kv:,} too" if moved <= (n - 1) * kv else
                f"the ring's (N-1) x KV is {(n - 1) * kv:,}")
        why = (f"but every rank held all {n} K, V blocks at once ({n * kv:,} bytes, N x KV: "
               "the whole sequence's keys, what context parallelism exists to avoid), with no "
               "transfer overlapping a block's compute" if used == ["all_gather"] else
               "but not as a ring of sends and receives")
        return Check(False, "not a ring", f"RIGHT VALUES, NOT A RING: the comm log shows "
                     f"{', '.join(used)}, which moved {moved:,.0f} bytes per rank ({same}), "
                     f"{why}. Pass one block at a time with ctx.comm.send / ctx.comm.recv.")
    worst = max(results, key=lambda res: res["sent"])
    if worst["sent"] > (n - 1) * worst["kv_bytes"]:
        return Check(False, "one pass too many", f"The outputs are right, but rank "
                     f"{worst['rank']} sent {worst['sent']} bytes, more than (N-1) x KV = "
                     f"{n - 1} x {worst['kv_bytes']}: after N-1 passes every rank has seen "
                     "every block; the N-th pass only brings a rank its own block back.")
    return Check(True, "", f"Correct: all {n} ranks match attention over the whole sequence, "
                 f"and each sent {worst['sent']} bytes = (N-1) x its K and V block. Causal "
                 "masks and the backward ring are what labkit's ring_attention adds.")


RING_BYTES = dict(model="Llama 3 70B", batch=1, seq=65536, heads=64, kv_heads=8, head_dim=128,
                  cp=16)


def check_ring_bytes(answer, verbose=True):
    """Bytes one rank sends in the forward ring of one attention layer (bf16 K and V)."""
    c = RING_BYTES
    n = c["cp"]
    kv = tcp.kv_block_bytes(c["batch"], c["kv_heads"], c["seq"], c["head_dim"], n)
    expected = tcp.comm_bytes_per_rank(c["batch"], c["heads"], c["seq"], c["head_dim"], n,
                                       kv_heads=c["kv_heads"])["forward"]
    mistakes = [
        Mistake(n * kv, "one pass too many", f"that is N = {n} passes; a rank already holds "
                f"its own block, so N-1 = {n - 1} passes bring it every other block"),
        Mistake(expected / 2, "K only", "that sends the keys alone; the values travel with "
                "them, a block of each"),
        Mistake(expected * c["heads"] / c["kv_heads"], "query heads", f"that uses the "
                f"{c['heads']} query heads; with grouped-query attention only the "
                f"{c['kv_heads']} KV heads' keys and values exist and travel"),
        Mistake(expected * n, "whole sequence", f"each block holds s/N = {c['seq'] // n} "
                f"tokens, not the whole {c['seq']}"),
        Mistake(kv, "one block", f"that is one block; the ring passes N-1 = {n - 1} of them"),
        Mistake(expected / 2, "values, not bytes", "that counts values; each bf16 value is 2 "
                "bytes"),
        Mistake(2 * expected, "fp32", "that counts 4 bytes per value; K and V are bf16"),
        Mistake(2 * expected, "forward and backward", "that adds the backward ring; the "
                "question asks for the forward alone"),
    ]
    return check_number(answer, expected, what=f"bytes one rank sends in the forward ring "
                        f"({c['model']}: b={c['batch']}, s={c['seq']}, h_kv={c['kv_heads']}, "
                        f"d={c['head_dim']}, CP={n}, bf16)", unit="bytes", mistakes=mistakes,
                        verbose=verbose,
                        hints=BYTES_HINTS,
                        explain="The backward sends as much again, plus the dK, dV sums.")
