"""Lesson 10's exercises: read a request's keys through its block table (the checker compares
with `PagedKVCache.read` on a pool whose blocks interleave and names the usual slips), the
bytes a contiguous cache wastes against a paged one, and how many requests a paged cache fits
(`check_gather_blocks`, `check_wasted_bytes`, `check_requests_that_fit`, against
`labkit.theory.serving_stream`)."""
import torch

from . import Check, Hints, Mistake, check_number, not_a_function, say, show
from ..parallel.paged_kv import PagedKVCache
from ..theory import serving_stream as theory

GATHER_HINTS = Hints(
    concept="token t of a request lives in block table[t // block_size], at slot "
            "t % block_size of that block; a request's blocks are wherever the pool had room, "
            "so they are not next to each other.",
    code="pos = torch.arange(length); blocks = torch.tensor(table)[pos // block_size]; "
         "return pool[blocks, pos % block_size]")


WASTE_HINTS = Hints(
    concept="a cache wastes the token slots it reserved but does not use; each slot holds a key "
            "and a value in every layer.",
    code="unused token slots x (2 x layers x kv_width x 2 bytes); contiguous: 512 - length per "
         "request; paged: the tail of each request's last block of 16.",
    exercise=2, kind="formula")
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


def check_wasted_bytes(contiguous, paged, verbose=True):
    """Bytes reserved but unused by 4 requests: a cache reserving max_len each, and a paged
    cache with blocks of 16 (Llama 3 8B's KV per token, bf16)."""
    c = WASTE_CASE
    per_token = theory.kv_bytes_per_token(c["layers"], c["kv_width"], c["bytes_per_value"])
    want_c = theory.contiguous_waste_tokens(c["lengths"], c["max_len"]) * per_token
    want_p = theory.paged_waste_tokens(c["lengths"], c["block_size"]) * per_token
    checks = []
    for answer, want, name in ((contiguous, want_c, "contiguous"), (paged, want_p, "paged")):
        checks.append(check_number(
            answer, want, unit="bytes", verbose=verbose,
            what=f"the bytes the {name} cache wastes",
            hints=WASTE_HINTS,
            mistakes=[Mistake(want / 2, "forgot k or v", "keys AND values: a factor 2"),
                      Mistake(want / c["layers"], "one layer", "every layer keeps its own")]))
    ok = all(checks)
    return Check(ok, "" if ok else "wrong", "; ".join(ch.message for ch in checks))


FIT_CASE = dict(budget_tokens=16384, length=300, max_len=4096, block_size=16)


def check_requests_that_fit(answer, verbose=True):
    """Requests of 300 tokens that a paged cache (blocks of 16) fits in 16,384 token slots."""
    c = FIT_CASE
    want = theory.requests_that_fit(c["budget_tokens"], c["length"],
                                    block_size=c["block_size"])
    contiguous = theory.requests_that_fit(c["budget_tokens"], c["length"], max_len=c["max_len"])
    return check_number(
        answer, want, exact=True, verbose=verbose,
        what="requests of 300 tokens in 16,384 slots, blocks of 16",
        hints=FIT_HINTS,
        mistakes=[Mistake(c["budget_tokens"] // c["length"], "no rounding up",
                          "a request holds whole blocks: ceil(300 / 16) = 19, not 18.75"),
                  Mistake(c["budget_tokens"] // c["block_size"]
                          // (c["length"] // c["block_size"]), "blocks rounded down",
                          "18 blocks of 16 hold 288 tokens: a request of 300 needs 19"),
                  Mistake(contiguous, "contiguous", "that is the cache reserving 4,096 each")],
        explain=f"A cache reserving the maximum length of 4,096 per request fits {contiguous}.")
