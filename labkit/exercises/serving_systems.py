"""Lesson 10's exercises: read a request's keys through its block table (the checker compares
with `PagedKVCache.read` on a pool whose blocks interleave and names the usual slips), the
bytes a contiguous cache wastes against a paged one, and how many requests a paged cache fits
(`check_gather_blocks`, `check_wasted_bytes`, `check_requests_that_fit`, against
`labkit.theory.serving_stream`)."""
import math

import torch

from . import (Check, Hints, Mistake, _answer_value, check_number, not_a_function, say,
               show)
from ..parallel.paged_kv import PagedKVCache
from ..theory import serving_stream as theory

GATHER_HINTS = Hints(
    concept="token t of a request lives in block table[t // block_size], at slot "
            "t % block_size of that block; a request's blocks are wherever the pool had room, "
            "so they are not next to each other.",
    code="pos = torch.arange(length); blocks = torch.tensor(table)[pos // block_size]; "
         "return pool[blocks, pos % block_size]")


WASTE_FORMULA = ("unused token slots x (2 x layers x kv_width x 2 bytes); contiguous: 512 - "
                 "length per request; paged: the tail of each request's last block of 16.")
WASTE_HINTS = Hints(   # what show_solution(2) prints: the formula of both numbers
    concept="a cache wastes the token slots it reserved but does not use; each slot holds a key "
            "and a value in every layer.",
    code=WASTE_FORMULA, exercise=2, kind="formula")
# one hint counter per number: a learner with both wrong gets each one's concept first
WASTE_NUMBER_HINTS = {
    "contiguous": Hints(
        concept="the contiguous cache reserves 512 token slots per request whatever its "
                "length, so each request leaves 512 - length of them unused; each slot holds "
                "a key and a value in every layer.",
        code=WASTE_FORMULA, exercise=2, kind="formula"),
    "paged": Hints(
        concept="the paged cache hands out whole blocks of 16 slots, so only the tail of each "
                "request's last block is unused; each slot holds a key and a value in every "
                "layer.",
        code=WASTE_FORMULA, exercise=2, kind="formula")}
FIT_HINTS = Hints(
    concept="a paged cache hands out whole blocks, so a request holds its length rounded up "
            "to a block.",
    code="(16,384 / 16) // ceil(300 / 16) requests.", exercise=3, kind="formula")
HINTS = {1: GATHER_HINTS, 2: WASTE_HINTS, 3: FIT_HINTS}


def show_solution(exercise=1):
    """Print the code (exercise 1) or the formula (2, 3)."""
    show(HINTS, exercise)


def gather_blocks(pool, table, length, block_size):
    """One answer: the request's first `length` rows through its block table."""
    pos = torch.arange(length)
    return pool[torch.tensor(table)[pos // block_size], pos % block_size]


def _case():
    """A pool of 8 blocks of 4 slots (width 3) where two requests grew a token at a time."""
    cache = PagedKVCache(layers=1, kv_width=3, num_blocks=8, block_size=4)
    g = torch.Generator().manual_seed(0)
    for stop in range(1, 11):
        for rid in (0, 1):
            cache.reserve(rid, stop)
            k = torch.randn(1, 3, generator=g)
            cache.write(0, rid, stop - 1, k, k)
    return cache


def check_gather_blocks(fn, verbose=True):
    """Run fn(pool, table, length, block_size) for request 1 of the case; compare."""
    if (refused := not_a_function(fn, "fn(pool, table, length, block_size)")) is not None:
        return say(refused, verbose)
    cache = _case()
    pool, table, length = cache.pool[0, 0], list(cache.tables[1]), 10
    want = cache.read(0, 1, length)[0]
    try:
        got = fn(pool.clone(), list(table), length, cache.block_size)
    except NotImplementedError:
        return say(Check(False, "not written", "NOT WRITTEN YET: your function raised "
                         f"NotImplementedError. Hint: {GATHER_HINTS.concept}"), verbose)
    except Exception as error:  # noqa: BLE001 - the learner's error, said in words
        return say(Check(False, "error", f"Your function raised {type(error).__name__}: "
                         f"{error}. {GATHER_HINTS.after_failure()}"), verbose)
    if not isinstance(got, torch.Tensor):
        return say(Check(False, "not a tensor", f"Return a tensor of shape ({length}, 3), "
                         f"not {type(got).__name__}."), verbose)
    if got.shape != want.shape:
        extra = (" All the slots of the last block came back: cut to `length` rows."
                 if got.numel() == len(table) * cache.block_size * 3 else "")
        return say(Check(False, "shape", f"Shape {tuple(got.shape)}, expected "
                         f"{tuple(want.shape)}.{extra} {GATHER_HINTS.after_failure()}"), verbose)
    if torch.equal(got, want):
        return say(Check(True, "", f"Correct: request 1's {length} keys read through its "
                         f"block table {table} (its blocks interleave with request 0's)."),
                   verbose)
    contiguous = pool.reshape(-1, 3)[table[0] * cache.block_size:][:length]
    why = (" That reads the blocks after its first one as if they followed it: they are "
           "wherever the pool had room." if torch.equal(got, contiguous) else "")
    return say(Check(False, "wrong rows", f"Wrong rows.{why} {GATHER_HINTS.after_failure()}"),
               verbose)


# ------------------------------------------------------------------------------- numbers

WASTE_CASE = dict(lengths=(37, 120, 301, 64), max_len=512, block_size=16, layers=32,
                  kv_width=1024, bytes_per_value=2)     # Llama 3 8B's KV: 8 heads x 128


def _waste_mistakes(want, reserved, c):
    """The likely wrong answers to one of exercise 2's numbers, each named for its slip."""
    heads, kv_heads = 32, c["kv_width"] // 128           # Llama 3 8B: 32 query heads of 128
    return [Mistake(want / 2, "forgot k or v", "keys AND values: a factor 2"),
            Mistake(want / c["bytes_per_value"], "values, not bytes",
                    "that counts values; each bf16 value is 2 bytes"),
            Mistake(want * heads / kv_heads, "no GQA",
                    f"that keeps all {heads} heads' keys and values ({heads * 128:,} values "
                    f"per layer); Llama 3 8B keeps {kv_heads} KV heads (GQA): "
                    f"{c['kv_width']:,} values per layer"),
            Mistake(want / c["layers"], "one layer", "every layer keeps its own"),
            Mistake(want / 2 ** 30, "units", "the right number in GiB (2^30 bytes); give it "
                                             "in bytes", "GiB, not bytes"),
            Mistake(want / 2 ** 20, "units", "the right number in MiB (2^20 bytes); give it "
                                             "in bytes", "MiB, not bytes"),
            Mistake(reserved, "reserved, not wasted",
                    "that is every slot the cache reserved; the question asks for the slots "
                    "reserved but unused: take away the tokens each request holds")]


def check_wasted_bytes(contiguous, paged, verbose=True):
    """Bytes reserved but unused by 4 requests: a cache reserving max_len each, and a paged
    cache with blocks of 16 (Llama 3 8B's KV per token, bf16). Each number has its own
    hint counter; the Check's `problems` name each number's slips ("paged: no GQA")."""
    c = WASTE_CASE
    per_token = theory.kv_bytes_per_token(c["layers"], c["kv_width"], c["bytes_per_value"])
    want_c = theory.contiguous_waste_tokens(c["lengths"], c["max_len"]) * per_token
    want_p = theory.paged_waste_tokens(c["lengths"], c["block_size"]) * per_token
    reserved_c = len(c["lengths"]) * c["max_len"] * per_token
    reserved_p = sum(theory.blocks_needed(n, c["block_size"]) * c["block_size"]
                     for n in c["lengths"]) * per_token
    checks = []
    for answer, want, reserved, name in ((contiguous, want_c, reserved_c, "contiguous"),
                                         (paged, want_p, reserved_p, "paged")):
        checks.append((name, check_number(
            answer, want, unit="bytes", verbose=verbose,
            what=f"the bytes the {name} cache wastes", hints=WASTE_NUMBER_HINTS[name],
            mistakes=_waste_mistakes(want, reserved, c))))
    ok = all(ch for _, ch in checks)
    problems = tuple(f"{name}: {p}" for name, ch in checks if not ch
                     for p in (ch.problems or (ch.problem,)))
    first = next((ch.problem for _, ch in checks if not ch), "")
    return Check(ok, first, "; ".join(ch.message for _, ch in checks), problems)


FIT_CASE = dict(budget_tokens=16384, length=300, max_len=4096, block_size=16)


def check_requests_that_fit(answer, verbose=True):
    """Requests of 300 tokens that a paged cache (blocks of 16) fits in 16,384 token slots."""
    c = FIT_CASE
    want = theory.requests_that_fit(c["budget_tokens"], c["length"],
                                    block_size=c["block_size"])
    contiguous = theory.requests_that_fit(c["budget_tokens"], c["length"], max_len=c["max_len"])
    blocks, per_request = c["budget_tokens"] // c["block_size"], theory.blocks_needed(
        c["length"], c["block_size"])
    unrounded = blocks / per_request                   # 1,024 blocks / 19 = 53.89 requests
    value = _answer_value(answer)
    # an answer near 53.89 but not whole (53.9) is the same slip as 53.89 itself
    near = value is not None and math.isfinite(value) and not float(value).is_integer() \
        and abs(value - unrounded) <= 0.01 * unrounded
    return check_number(
        answer, want, exact=True, verbose=verbose,
        what="requests of 300 tokens in 16,384 slots, blocks of 16",
        hints=FIT_HINTS,
        mistakes=[Mistake(c["budget_tokens"] // c["length"], "no rounding up",
                          "a request holds whole blocks: ceil(300 / 16) = 19, not 18.75"),
                  Mistake(math.ceil(unrounded), "count rounded up",
                          f"{blocks:,} blocks / {per_request} per request = {unrounded:.2f} "
                          f"requests, rounded up: the {math.ceil(unrounded)}th would not get "
                          "its 19 blocks; round the count down"),
                  Mistake(value if near else unrounded, "not whole",
                          f"{blocks:,} / {per_request} = {unrounded:.2f} is not a number of "
                          "requests: a request fits whole or waits, so round down (//)"),
                  Mistake(c["budget_tokens"] // c["block_size"]
                          // (c["length"] // c["block_size"]), "blocks rounded down",
                          "18 blocks of 16 hold 288 tokens: a request of 300 needs 19"),
                  Mistake(contiguous, "contiguous", "that is the cache reserving 4,096 each")],
        explain=f"A cache reserving the maximum length of 4,096 per request fits {contiguous}.")
