"""Requests that begin with one system prompt share its keys and values, as the PagedAttention
paper (vLLM 2023: Kwon et al. SOSP'23, arXiv 2309.06180, section 4.4) describes it: the prompt
is prefilled once and every request's block table points at its blocks, explicitly (reference
counted, copy-on-write: `PagedKVCache.share`). Today's engines find shared prefixes by
themselves: vLLM v1's automatic prefix caching names full blocks by chained hashes and reuses
them across requests (`PagedKVCache(enable_prefix_caching=True)`, which the batching engine
uses); SGLang's RadixAttention (Zheng et al. 2023, arXiv 2312.07104) keeps them in a radix tree.

n requests of a P-token prefix in blocks of B hold n x floor(P / B) - ceil(P / B) blocks fewer
than if each held its own copy (`theory.serving_stream.prefix_saved_blocks`), and prefill
P x (n - 1) tokens fewer. `shared_prefix_generate` serves them as one batch, with or without
sharing, so both the tokens (equal) and the blocks (fewer) are measured on the same requests.
"""
import torch

from .paged_kv import PagedKVCache, check_model, ragged_forward

PREFIX = -1            # the cache's id of the shared prompt (requests are 0..n-1)


@torch.no_grad()
def shared_prefix_generate(model, prefix, suffixes, new_tokens, block_size=8, share=True):
    """Greedy `new_tokens` tokens of `model` for prefix + each suffix (1-D ids), served as one
    ragged batch through a paged cache; share=True: the prefix is prefilled once and its
    blocks shared. Returns (tokens per request, stats): stats are the cache's at the end
    (`PagedKVCache.stats`) plus peak_blocks, peak_bytes and prefill_tokens, measured."""
    check_model(model)
    if prefix.numel() < 1 or any(s.numel() < 1 for s in suffixes) or new_tokens < 1:
        raise ValueError("shared_prefix_generate needs a prefix, a suffix of at least one "
                         "token per request and new_tokens >= 1")
    layers, width = len(model.blocks), model.blocks[0].attn.qkv.out_features // 3
    p = prefix.numel()
    lengths = [p + s.numel() for s in suffixes]
    slots = sum(n + new_tokens for n in lengths) + p
    cache = PagedKVCache(layers, width, -(-slots // block_size) + 2 * len(suffixes) + 1,
                         block_size)
    if share:
        cache.reserve(PREFIX, p)
        ragged_forward(model, [(PREFIX, prefix, 0)], cache)
        for rid in range(len(suffixes)):
            cache.share(rid, PREFIX, p)
        pieces = [(rid, s, p) for rid, s in enumerate(suffixes)]
    else:
        pieces = [(rid, torch.cat([prefix, s]), 0) for rid, s in enumerate(suffixes)]
    prefill = sum(ids.numel() for _, ids, _ in pieces) + (p if share else 0)
    tokens = [[] for _ in suffixes]
    for step in range(new_tokens):
        for rid, n in enumerate(lengths):
            cache.reserve(rid, n + step)      # a shared partial block is copied here
        logits = ragged_forward(model, pieces, cache)
        for rid, row in enumerate(logits):
            tokens[rid].append(int(row.argmax()))
        pieces = [(rid, torch.tensor(t[-1:]), n + step) for rid, (t, n)
                  in enumerate(zip(tokens, lengths))]
    stats = dict(cache.stats(), peak_blocks=cache.peak_blocks, prefill_tokens=prefill,
                 peak_bytes=cache.peak_blocks * block_size * cache.bytes_per_slot)
    return tokens, stats
