"""A paged KV cache: fixed-size blocks from one pool, a block table per request (Kwon et al.
SOSP'23, "Efficient Memory Management for LLM Serving with PagedAttention", arXiv 2309.06180).

The pool holds, for every layer, keys and values of `num_blocks` blocks of `block_size` token
slots: 2 x layers x num_blocks x block_size x kv_width x bytes, allocated once. A request owns
a list of block ids (its block table); token t of the request lives in slot t % B of block
table[t // B]. A request grows one block at a time, so it wastes at most B - 1 slots (internal
fragmentation), instead of the (L_max - len) slots a cache that reserves the maximum length
wastes. Attention reads through the table: here by gathering the request's blocks into one
(len, width) k and v (clarity over speed; vLLM's kernel reads the blocks in place).

Automatic prefix caching (vLLM v1's, `enable_prefix_caching`): every full block of a request
is named by a chained hash, h_i = H(h_(i-1), its B token ids), so equal hashes mean equal
prefixes, and kept in a table hash -> block (`commit`, after its keys are written). A request
admitted (`admit`) first takes the longest run of its prompt's full blocks already cached (at
most (len - 1) // B: its last token is computed for its logits): those tokens are hits, not
prefilled again. A finished request's blocks go back to the free queue but keep their hash, so
a later request can still hit them; a block is evicted (its hash forgotten) only when the
pool hands it out again, least recently freed first (LRU, the tail of a request before its
head). Measured: queries (prompt tokens looked up at admission), hits, hit rate = hits /
queries, evictions.

Prefix sharing as the PagedAttention paper (vLLM 2023, section 4.4) describes it, explicit and
copy-on-write: requests that begin with a common system prompt point their tables at the same
physical blocks, each block counting the tables that hold it (`share`); a block returns to the
pool when its count falls to 0. A request about to write into a block others still hold first
takes a private copy of it (copy-on-write, in `reserve`), so nobody's keys change under anyone
else. n requests sharing a P-token prefix save n x floor(P / B) - ceil(P / B) blocks against
each holding its own (the prefix kept once; a partly filled last block is copied by each
request that grows).

The contiguous cache of lesson 09's servers is the special case block_size = L_max with the one
block taken at admission: `PagedKVCache.contiguous(max_len, ...)`, so both are measured by the
same code.

`ragged_forward` runs a TinyGPT-shaped model once on a ragged batch (each request's new tokens
at its own positions) through the cache: what continuous batching (batching.py), speculative
decoding (speculative.py) and disaggregated prefill (disaggregated.py) share, with the
per-request sampling they share (`SamplingParams`: vLLM's temperature, top-p and seed; greedy
at temperature 0).
"""
import hashlib
import math
from dataclasses import dataclass

import torch

from ..theory.block_pool import BlockPool


class PagedKVCache(BlockPool):
    """Blocks of `block_size` token slots for `layers` layers of `kv_width` keys and values.

    The block tables are theory/block_pool.BlockPool's (the simulator's too): reserve(rid,
    tokens) makes room for a request's first `tokens` tokens (False when the pool has too few
    free blocks); free(rid) returns its blocks (those no other request shares); share(rid,
    parent, tokens) points a new request at the parent's blocks of its first `tokens` tokens
    (the paper's copy-on-write sharing). `reserve_whole`: a request takes all blocks it may
    ever need at once (the contiguous cache reserving the maximum length).
    enable_prefix_caching: admit(rid, ids) reuses cached full blocks, commit(rid, ids) caches
    them (vLLM v1's automatic prefix caching). Here: write(layer, rid, start, k, v) stores rows
    start.. of (n, width) k and v; read(layer, rid, length) gathers its first `length` keys and
    values."""

    def __init__(self, layers, kv_width, num_blocks, block_size, dtype=torch.float32,
                 reserve_whole=False, enable_prefix_caching=False):
        for name, value in (("layers", layers), ("kv_width", kv_width),
                            ("num_blocks", num_blocks), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"PagedKVCache needs {name} >= 1, got {value}")
        super().__init__(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                         reserve_whole=reserve_whole)
        self.pool = torch.zeros(layers, 2, num_blocks, block_size, kv_width, dtype=dtype)

    @classmethod
    def contiguous(cls, layers, kv_width, max_len, budget_tokens, dtype=torch.float32):
        """A cache that reserves `max_len` slots per request in the same pool of
        `budget_tokens` slots: one block of max_len each, taken at admission."""
        return cls(layers, kv_width, budget_tokens // max_len, max_len, dtype, reserve_whole=True)

    def _copy_block(self, old, new):
        self.pool[:, :, new] = self.pool[:, :, old]

    # -------------------------------------------------------------------------- prefix caching
    def _names(self, ids):
        """Full block i's name: SHA-256 of its parent's name and its token ids (chained)."""
        def name(i, parent):
            block = ids[i * self.block_size:(i + 1) * self.block_size]
            return hashlib.sha256(parent + b"|" + ",".join(map(str, block)).encode()).digest()
        return name

    def admit(self, rid, ids):
        """Make room for a new request's tokens `ids` (its sequence, a list or 1-D tensor),
        taking the cached blocks of its longest cached prefix first (prefix caching on).
        Returns the tokens found cached (0 without prefix caching), or None when the pool has
        too few free blocks (nothing taken, nothing counted)."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(t) for t in ids]
        return self.admit_named(rid, len(ids), self._names(ids))

    def commit(self, rid, ids):
        """Name the full blocks of `ids`, the request's first tokens whose keys and values are
        written now, and cache each block whose name is new (prefix caching on)."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(t) for t in ids]
        self.commit_named(rid, len(ids), self._names(ids))

    # -------------------------------------------------------------------------- data
    def _slots(self, rid, start, stop):
        """(block ids, offsets) of token positions start..stop-1 through the block table."""
        pos = torch.arange(start, stop)
        table = torch.tensor(self.tables[rid])
        return table[pos // self.block_size], pos % self.block_size

    def write(self, layer, rid, start, k, v):
        """Store rows start..start+n-1 of request `rid` (k, v: (n, kv_width)) in its blocks."""
        stop = start + k.shape[0]
        if stop > self.lengths.get(rid, 0):
            raise ValueError(f"request {rid}: write up to token {stop} but only "
                             f"{self.lengths.get(rid, 0)} reserved (call reserve first)")
        blocks, offsets = self._slots(rid, start, stop)
        if any(self.refs[b] > 1 for b in set(blocks.tolist())):
            raise ValueError(f"request {rid}: write into a block another request shares "
                             "(reserve first: it copies the block)")
        self.pool[layer, 0, blocks, offsets] = k
        self.pool[layer, 1, blocks, offsets] = v

    def read(self, layer, rid, length):
        """The request's first `length` keys and values, gathered from its blocks: (length, w)."""
        blocks, offsets = self._slots(rid, 0, length)
        return self.pool[layer, 0, blocks, offsets], self.pool[layer, 1, blocks, offsets]

    # -------------------------------------------------------------------------- accounting
    @property
    def bytes_per_slot(self):
        """One token's keys and values in every layer: 2 x layers x kv_width x bytes."""
        layers, two, _, _, width = self.pool.shape
        return layers * two * width * self.pool.element_size()

    def nbytes(self):
        """The pool's bytes (allocated once, used or not)."""
        return self.pool.nbytes

    def stats(self):
        """Measured from the block tables now: blocks in use, token slots in use (each
        request's, shared ones counted per request), slots held and those of them holding a
        token (shared ones once), the bytes held but holding no token, and the bytes sharing
        saves (blocks in the tables beyond those in use)."""
        filled = {}                 # block -> its slots holding a token of some request
        for rid, table in self.tables.items():
            for i, block in enumerate(table):
                slots = min(self.block_size, self.lengths[rid] - i * self.block_size)
                filled[block] = max(filled.get(block, 0), slots)
        held = self.blocks_used * self.block_size
        listed = sum(len(t) for t in self.tables.values())
        return dict(used=self.blocks_used, total=self.num_blocks, block_size=self.block_size,
                    tokens=sum(self.lengths.values()), reserved_tokens=held,
                    filled_tokens=sum(filled.values()),
                    wasted_bytes=(held - sum(filled.values())) * self.bytes_per_slot,
                    shared_blocks=sum(r > 1 for r in self.refs.values()), copies=self.copies,
                    saved_bytes=(listed - self.blocks_used) * self.block_size
                    * self.bytes_per_slot, pool_bytes=self.nbytes())


# ------------------------------------------------------------------ the forward through it

def check_model(model):
    """One-line TypeError unless `model` has TinyGPT's parts the ragged step calls."""
    needed = ("tok", "pos", "blocks", "ln_f", "head")
    missing = [n for n in needed if not hasattr(model, n)]
    if not missing:
        missing = [f"blocks[{i}].{n}" for i, b in enumerate(model.blocks)
                   for n in ("ln1", "attn", "ln2", "mlp") if not hasattr(b, n)]
    if missing:
        raise TypeError(f"the batching engine runs TinyGPT-shaped models (tok, pos, blocks with "
                        f"ln1/attn/ln2/mlp, ln_f, head); {type(model).__name__} lacks "
                        f"{missing[0]}")


def attend(q, k, v, heads):
    """One request's causal attention: q (n, width) are the last n of the k, v (L, width)
    positions. The same ops in the same order as `labkit.models.causal_attention` (which
    parallel/ does not import), so a request's attention never mixes in its neighbours; its
    logits can still differ from it alone at the rounding level (a Linear over more rows may
    sum in another order; lesson 10 measures it), which flips a token only in a near tie."""
    n, width = q.shape
    d, length = width // heads, k.shape[0]
    q, k, v = (t.reshape(t.shape[0], heads, d).transpose(0, 1) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    future = torch.arange(length) > torch.arange(length - n, length)[:, None]
    out = scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v
    return out.transpose(0, 1).reshape(n, width)


@torch.no_grad()
def ragged_forward(model, pieces, cache, every_token=False):
    """pieces: [(request id, ids (n,), start position)] -> (len(pieces), vocab) logits of each
    piece's last token (every_token: (all tokens, vocab), for speculative decoding's check).
    Writes each piece's keys and values into `cache` (reserved first)."""
    ids = torch.cat([p[1] for p in pieces])
    positions = torch.cat([torch.arange(s, s + p.numel()) for _, p, s in pieces])
    x = (model.tok(ids) + model.pos(positions)).unsqueeze(0)   # (1, tokens, hidden)
    bounds, at = [], 0
    for _, piece, _ in pieces:
        bounds.append((at, at + piece.numel()))
        at += piece.numel()
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        q, k, v = attn.qkv(block.ln1(x)).chunk(3, dim=-1)
        heads = q.shape[-1] // attn.head_dim    # this rank's heads under tensor parallelism
        outs = []
        for (rid, _, start), (a, b) in zip(pieces, bounds):
            cache.write(layer, rid, start, k[0, a:b], v[0, a:b])
            keys, values = cache.read(layer, rid, start + b - a)
            outs.append(attend(q[0, a:b], keys, values, heads))
        x = x + attn.proj(torch.cat(outs)[None])
        x = x + block.mlp(block.ln2(x))
    if every_token:
        return model.head(model.ln_f(x[0]))
    last = torch.tensor([b - 1 for _, b in bounds])
    return model.head(model.ln_f(x[0, last]))


def batch_logits(model, sequences):
    """(together, alone): the logits of each of `sequences`' (1-D token ids) last token, from
    all of them run together in one ragged pass and from each run alone, both (len(sequences),
    vocab): the next-token logits an engine step computes, with and without neighbours."""
    width = model.blocks[0].attn.qkv.out_features // 3

    def logits(batch):
        cache = PagedKVCache(len(model.blocks), width, sum(s.numel() for _, s in batch), 1)
        for rid, s in batch:
            cache.reserve(rid, s.numel())
        return ragged_forward(model, [(rid, s, 0) for rid, s in batch], cache)
    with torch.no_grad():
        return logits(list(enumerate(sequences))), torch.cat([logits([(0, s)])
                                                               for s in sequences])


def batch_logit_gap(model, sequences):
    """Largest |logit alone - logit batched| of the next tokens (batch_logits; measured): 0 is
    batch invariance; a token can flip only where its top two logits are closer than it."""
    together, alone = batch_logits(model, sequences)
    return (together - alone).abs().max().item()


# ------------------------------------------------------------------ sampling a token

@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its next token, as vLLM's SamplingParams: `temperature` 0 is greedy
    (exactly the argmax), else the logits are divided by it before the softmax; `top_p` keeps
    the smallest set of most likely tokens whose probability reaches it (nucleus sampling,
    Holtzman et al. ICLR'20), renormalised; `seed` gives the request a generator of its own,
    so its draws do not depend on which requests share its steps (None: torch's global one)."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or
                                      not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self):
        return self.temperature == 0

    def generator(self):
        """The request's own generator (None: torch's global one)."""
        return None if self.seed is None else torch.Generator().manual_seed(self.seed)

    def probs(self, logits):
        """The distribution the token is drawn from, (..., vocab) float64: one-hot at the
        argmax when greedy, else softmax(logits / temperature) cut to the top-p nucleus."""
        logits = logits.double()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
        probs = (logits / self.temperature).softmax(-1)
        if self.top_p < 1:
            sorted_p, order = probs.sort(-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p          # mass of the likelier tokens
            sorted_p = sorted_p.masked_fill(before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


def draw(probs, generator=None):
    """One token id drawn from a (vocab,) distribution; a one-hot gives its token exactly and
    draws nothing (greedy decoding leaves every random state as it was)."""
    top = int(probs.argmax())
    if probs[top] == 1:
        return top
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token(logits, params, generator=None):
    """A request's next token from its (vocab,) logits: the argmax when greedy (bit for bit
    the greedy path), else a draw from params.probs with the request's generator."""
    if params.greedy:
        return int(logits.argmax())
    return draw(params.probs(logits), generator)
