"""Prefill and decode on separate ranks (disaggregation: DistServe, Zhong et al. OSDI'24, arXiv
2401.09670; Splitwise, Patel et al. ISCA'24, arXiv 2311.18677).

Prefill is compute-bound and decode memory-bound; on the same GPU a prefill stalls the
running decodes (lesson 10, section 5) and both share one parallel layout. Disaggregation runs
them on different GPUs: the prefill rank computes a request's prompt and sends its keys and
values and first token to the decode rank, which adds the request to its running batch. The
price is the KV transfer, per request:

    layers x 2 x kv_heads x head_dim x prompt tokens x bytes

here measured from the comm log (tag "kv transfer") against that formula.

`disaggregated_generate` runs on a group of N + 1 ranks: ranks 0..N-1 prefill (request i on
rank i % N), the last rank decodes, taking the requests in order; it runs one decode step for
every running request between receives, so the decodes go on while the next prompts are
prefilled elsewhere (with N > 1, several at once: DistServe sizes the prefill and decode
instances apart, as prompts and answers need).
"""
import torch

from ..runtime.context import context
from .paged_kv import PagedKVCache, check_model, ragged_forward

TAG = "kv transfer"


def _layers_width(model):
    return len(model.blocks), model.blocks[0].attn.qkv.out_features // 3


@torch.no_grad()
def disaggregated_generate(model, prompts, new_tokens, group=None, block_size=8):
    """prompts: list of 1-D ids; new_tokens: list of ints. On the decode rank (the group's
    last) returns every request's greedy tokens; on a prefill rank returns None."""
    check_model(model)
    ctx = context()
    group = ctx.group(group)
    if group.size < 2:
        raise ValueError(f"disaggregated_generate needs at least 2 ranks (prefill ranks, then "
                         f"one decode rank), got {group.size}")
    layers, width = _layers_width(model)
    slots = sum(p.numel() + n for p, n in zip(prompts, new_tokens))
    cache = PagedKVCache(layers, width, -(-slots // block_size) + len(prompts), block_size)
    if group.rank < group.size - 1:
        _prefill(ctx, group, model, cache, prompts)
        return None
    return _decode(ctx, group, model, cache, prompts, new_tokens)


def _prefill(ctx, group, model, cache, prompts):
    pending, decoder = [], group.size - 1
    for rid in range(group.rank, len(prompts), decoder):     # this prefill rank's requests
        prompt = prompts[rid]
        cache.reserve(rid, prompt.numel())
        first = ragged_forward(model, [(rid, prompt, 0)], cache)[0].argmax()
        kv = torch.stack([torch.stack(cache.read(layer, rid, prompt.numel()))
                          for layer in range(len(model.blocks))])   # (layers, 2, P, width)
        for handle in pending:          # the previous request's buffers may be reused now
            handle.wait()
        pending = [ctx.comm.send(kv.contiguous(), decoder, group, async_op=True, tag=TAG),
                   ctx.comm.send(first.reshape(1), decoder, group, async_op=True,
                                 tag="first token")]
        cache.free(rid)
    for handle in pending:
        handle.wait()


def _decode(ctx, group, model, cache, prompts, new_tokens):
    layers, width = _layers_width(model)
    tokens = {rid: [] for rid in range(len(prompts))}
    running, lengths = [], {}
    for rid, prompt in enumerate(prompts):
        src = rid % (group.size - 1)       # the prefill rank that took it
        kv = ctx.comm.recv(torch.empty(layers, 2, prompt.numel(), width), src, group, tag=TAG)
        first = ctx.comm.recv(torch.empty(1, dtype=torch.int64), src, group, tag="first token")
        cache.reserve(rid, prompt.numel())
        for layer in range(layers):
            cache.write(layer, rid, 0, kv[layer, 0], kv[layer, 1])
        tokens[rid].append(int(first))
        lengths[rid] = prompt.numel()
        running.append(rid)
        running = _decode_step(model, cache, running, tokens, lengths, new_tokens)
    while running:
        running = _decode_step(model, cache, running, tokens, lengths, new_tokens)
    return [tokens[rid] for rid in range(len(prompts))]


def _decode_step(model, cache, running, tokens, lengths, new_tokens):
    """One decode step for every running request that still wants tokens; returns them."""
    running = [r for r in running if len(tokens[r]) < new_tokens[r]]
    if not running:
        return running
    for r in running:
        cache.reserve(r, lengths[r] + 1)
    logits = ragged_forward(model, [(r, torch.tensor(tokens[r][-1:]), lengths[r])
                                    for r in running], cache)
    for r, row in zip(running, logits):
        lengths[r] += 1
        tokens[r].append(int(row.argmax()))
    for r in [r for r in running if len(tokens[r]) >= new_tokens[r]]:
        cache.free(r)
    return [r for r in running if len(tokens[r]) < new_tokens[r]]
