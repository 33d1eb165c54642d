"""A paged KV cache's bookkeeping without its tensors: which blocks each request holds.

The pool's `num_blocks` blocks of `block_size` token slots (Kwon et al. 2023, vLLM's
PagedAttention) are handed out from one free queue: never-used blocks first, then freed blocks
least recently freed first (a request's tail goes back first, so it is evicted first). A
request's table lists its blocks in order; `refs` counts the tables holding each block, so a
block two requests share (the paper's copy-on-write `share`) is copied before either writes
into it. With `enable_prefix_caching` (vLLM v1's automatic prefix caching) every full block
written gets a name chained from its parent's (`name(i, parent)`: the engine hashes the token
ids, the simulator names its synthetic prompts); a new request takes the cached blocks of its
longest named prefix instead of computing them again, reviving them from the free queue, and
a cached block handed out to someone else is evicted. Hit rate = tokens found / tokens looked
up. parallel/paged_kv.PagedKVCache adds the keys and values; theory/stream_sim uses it as is,
so the simulator counts what the engine counts.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Block tables, reference counts, the free queue and the prefix cache (module docstring).

    `reserve_whole`: a request takes one block of `block_size` slots at once (the contiguous
    cache reserving the maximum length)."""

    def __init__(self, num_blocks, block_size, *, enable_prefix_caching=False,
                 reserve_whole=False):
        if enable_prefix_caching and reserve_whole:
            raise ValueError("prefix caching names full blocks of a paged cache; the contiguous "
                             "cache's one block per request is never full and shared")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.reserve_whole, self.enable_prefix_caching = reserve_whole, enable_prefix_caching
        # the free queue: never-used blocks fresh.., then the freed ones, least recent first
        # (counted, not listed, so a simulated pool may be as large as it likes)
        self.fresh, self.recycled = 0, deque()
        self.tables, self.lengths = {}, {}
        self.refs = {}                                # block -> tables holding it
        self.peak_blocks = self.copies = 0
        self.block_name, self.cached = {}, {}         # block -> name, name -> block
        self.chains = {}                              # request -> names of its full blocks
        self.queries = self.hits = self.evictions = 0

    # -------------------------------------------------------------------------- allocation
    @property
    def free_count(self):
        return self.num_blocks - self.fresh + len(self.recycled)

    @property
    def blocks_used(self):
        return self.num_blocks - self.free_count

    def blocks_for(self, tokens):
        return 1 if self.reserve_whole else -(-tokens // self.block_size)

    def _shared_ahead(self, rid, tokens):
        """Indices in rid's table of shared blocks its tokens length..tokens-1 land in: each
        must be copied before it is written (copy-on-write)."""
        table, have = self.tables.get(rid, ()), self.lengths.get(rid, 0)
        if tokens <= have:
            return []
        return [i for i in range(have // self.block_size, len(table))
                if self.refs[table[i]] > 1]

    def can_reserve(self, rid, tokens):
        """Whether reserve(rid, tokens) would succeed (without doing it); a count of tokens
        that is not a positive integer is refused (ValueError)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"reserve: tokens must be a positive integer (the request's first "
                             f"tokens to hold), got {tokens!r} for request {rid!r}")
        if tokens > self.num_blocks * self.block_size or (
                self.reserve_whole and tokens > self.block_size):
            return False
        need = self.blocks_for(tokens) - len(self.tables.get(rid, ()))
        return max(0, need) + len(self._shared_ahead(rid, tokens)) <= self.free_count

    def _take(self):
        if self.fresh < self.num_blocks:
            block, self.fresh = self.fresh, self.fresh + 1
        else:
            block = self.recycled.popleft()
        if block in self.block_name:          # a cached free block handed out: evicted
            del self.cached[self.block_name.pop(block)]
            self.evictions += 1
        self.refs[block] = 1
        return block

    def _copy_block(self, old, new):
        """Copy-on-write's copy of the block's contents (none here: PagedKVCache's tensors)."""

    def reserve(self, rid, tokens):
        """Give `rid` blocks for its first `tokens` tokens; False (nothing taken) if too few.
        A shared block the new tokens land in is copied first (copy-on-write)."""
        if not self.can_reserve(rid, tokens):
            return False
        table = self.tables.setdefault(rid, [])
        for i in self._shared_ahead(rid, tokens):
            old, table[i] = table[i], self._take()
            self._copy_block(old, table[i])
            self.refs[old] -= 1
            self.copies += 1
        while len(table) < self.blocks_for(tokens):
            table.append(self._take())
        self.lengths[rid] = max(self.lengths.get(rid, 0), tokens)
        self.peak_blocks = max(self.peak_blocks, self.blocks_used)
        return True

    def share(self, rid, parent, tokens):
        """Point new request `rid` at `parent`'s blocks holding its first `tokens` tokens
        (written already: a common prompt); the blocks count one more holder."""
        if self.reserve_whole:
            raise ValueError("prefix sharing needs a paged cache (blocks), not the contiguous "
                             "one: each request's single block holds its whole sequence")
        if rid in self.tables:
            raise ValueError(f"request {rid} holds blocks already; share a prefix before "
                             "reserving")
        if not 1 <= tokens <= self.lengths.get(parent, 0):
            raise ValueError(f"request {parent} holds {self.lengths.get(parent, 0)} tokens, "
                             f"cannot share {tokens}")
        self.tables[rid] = self.tables[parent][:self.blocks_for(tokens)]
        for block in self.tables[rid]:
            self.refs[block] += 1
        self.lengths[rid] = tokens

    def free(self, rid):
        """Drop the request's hold on its blocks (it finished or was preempted); those no
        other request holds go back to the pool."""
        for block in reversed(self.tables.pop(rid, [])):   # the tail is evicted first
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.recycled.append(block)
        self.lengths.pop(rid, None)
        self.chains.pop(rid, None)

    # -------------------------------------------------------------------------- prefix caching
    def admit_named(self, rid, length, name):
        """Make room for a new request of `length` tokens, taking the cached blocks of its
        longest cached prefix first (prefix caching on; `name(i, parent)`: full block i's name
        after its parent's). Returns the tokens found cached (0 without prefix caching), or
        None when the pool has too few free blocks (nothing taken, nothing counted)."""
        if rid in self.tables:
            raise ValueError(f"request {rid} holds blocks already; admit it once")
        if not self.enable_prefix_caching:
            return 0 if self.reserve(rid, length) else None
        chain, hit, parent = [], [], b""
        for i in range((length - 1) // self.block_size):
            parent = name(i, parent)
            if parent not in self.cached:
                break
            chain.append(parent)
            hit.append(self.cached[parent])
        revived = sum(self.refs[b] == 0 for b in hit)      # cached blocks now on the free queue
        need = self.blocks_for(length) - len(hit)
        if length > self.num_blocks * self.block_size or need + revived > self.free_count:
            return None
        for block in hit:
            if self.refs[block] == 0:
                self.recycled.remove(block)
            self.refs[block] += 1
        found = len(hit) * self.block_size
        self.tables[rid], self.chains[rid], self.lengths[rid] = list(hit), chain, found
        self.reserve(rid, length)            # fits: checked above
        self.queries += length
        self.hits += found
        return found

    def commit_named(self, rid, written, name):
        """Name the full blocks of the request's first `written` tokens (written now) and cache
        each block whose name is new (prefix caching on)."""
        if not self.enable_prefix_caching:
            return
        chain, table = self.chains.setdefault(rid, []), self.tables[rid]
        for i in range(len(chain), written // self.block_size):
            chain.append(name(i, chain[-1] if chain else b""))
            if chain[-1] not in self.cached and table[i] not in self.block_name:
                self.cached[chain[-1]], self.block_name[table[i]] = table[i], chain[-1]

    def prefix_stats(self):
        """Prefix caching so far: prompt tokens looked up at admission, tokens found cached
        (prefill saved), hit rate = hits / queries, blocks cached now, evictions."""
        return dict(queries=self.queries, hits=self.hits,
                    hit_rate=self.hits / self.queries if self.queries else 0.0,
                    prefill_tokens_saved=self.hits, cached_blocks=len(self.cached),
                    evictions=self.evictions)
