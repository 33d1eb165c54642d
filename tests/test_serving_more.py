"""Serving systems, the rest: prefix sharing in the paged cache (copy-on-write, reference
counts), `run serve` with a draft model and with disaggregated prefill, and `plan --serve
--rate` (the stream scheduler modelled without a model, against the engine's own times)."""
import json
import subprocess
import sys
from functools import partial

import pytest
import torch

from labkit import models
from labkit.parallel import serving
from labkit.parallel.paged_kv import PagedKVCache
from labkit.parallel.prefix_sharing import shared_prefix_generate
from labkit.theory import serving_stream as theory


def _ids(n, seed):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ prefix sharing

def test_shared_blocks_are_counted_and_copied_on_write():
    cache = PagedKVCache(layers=1, kv_width=2, num_blocks=8, block_size=4)
    prompt = torch.arange(12.0).reshape(6, 2)
    assert cache.reserve("sys", 6)
    cache.write(0, "sys", 0, prompt, -prompt)
    cache.share("a", "sys", 6)
    cache.share("b", "sys", 6)
    assert cache.tables["a"] == cache.tables["b"] == cache.tables["sys"]
    assert cache.blocks_used == 2 and cache.refs[cache.tables["sys"][0]] == 3
    with pytest.raises(ValueError, match="shares"):
        cache.write(0, "a", 5, torch.ones(1, 2), torch.ones(1, 2))
    assert cache.reserve("a", 7)            # token 6 lands in the shared half-full block: copy
    assert cache.copies == 1 and cache.tables["a"][0] == cache.tables["sys"][0]
    assert cache.tables["a"][1] != cache.tables["sys"][1]
    cache.write(0, "a", 6, torch.full((1, 2), 99.0), torch.full((1, 2), 99.0))
    k, _ = cache.read(0, "a", 7)
    assert torch.equal(k[:6], prompt) and k[6, 0] == 99
    assert torch.equal(cache.read(0, "sys", 6)[0], prompt)     # the original is untouched
    assert torch.equal(cache.read(0, "b", 6)[0], prompt)
    cache.free("sys")
    cache.free("b")
    assert cache.blocks_used == 2           # a still holds the first block and its copy
    cache.free("a")
    assert cache.blocks_used == 0 and set(cache.refs) == {0}
    with pytest.raises(ValueError, match="paged cache"):
        PagedKVCache.contiguous(1, 2, 8, 16).share("x", "y", 1)


@pytest.mark.parametrize("prefix_len,block_size", [(19, 4), (16, 8)])
def test_prefix_sharing_saves_the_blocks_the_formula_says_and_tokens_equal(prefix_len,
                                                                            block_size):
    model = models.build("gpt", seed=0, seq=48, layers=2).eval()
    prefix, suffixes = _ids(prefix_len, 1), [_ids(n, 10 + n) for n in (3, 7, 1, 5)]
    shared, s = shared_prefix_generate(model, prefix, suffixes, 6, block_size)
    alone, a = shared_prefix_generate(model, prefix, suffixes, 6, block_size, share=False)
    want = [serving.generate(model, torch.cat([prefix, x])[None], 6)[0].tolist()
            for x in suffixes]
    assert shared == alone == want
    saved = a["peak_blocks"] - s["peak_blocks"]
    assert saved == theory.prefix_saved_blocks(4, prefix_len, block_size) > 0
    assert a["peak_bytes"] - s["peak_bytes"] == saved * block_size * 2 * 2 * 64 * 4
    assert s["copies"] == (4 if prefix_len % block_size else 0)
    assert a["prefill_tokens"] - s["prefill_tokens"] == 3 * prefix_len
