"""Plausible wrong answers to the code exercises, as a learner would write them. A module of
their own, importing torch only: the ranks import them by name, and importing the test module
(nbformat, the editions) would take a loaded machine's whole time-out."""
import torch


def all_reduce_then_slice(ctx, grad):
    """Right values, but an all-reduce: twice the bytes, and the whole gradient on every rank."""
    ctx.comm.all_reduce(grad)
    return grad.chunk(ctx.world_size)[ctx.rank] / ctx.world_size


def summed_shard(ctx, grad):
    return ctx.comm.reduce_scatter(grad)


def blocking_ring(ctx, tensor):
    """The ring of lesson 01 with blocking sends: every rank sends first and waits there."""
    n, r = ctx.world_size, ctx.rank
    chunks = list(torch.tensor_split(tensor, n))
    for step in range(2 * (n - 1)):
        out_i, in_i = ((r - step) % n, (r - step - 1) % n) if step < n - 1 else \
            ((r + 1 - step) % n, (r - step) % n)
        ctx.comm.send(chunks[out_i].clone(), (r + 1) % n)
        incoming = torch.empty_like(chunks[in_i])
        ctx.comm.recv(incoming, (r - 1) % n)
        chunks[in_i] = chunks[in_i] + incoming if step < n - 1 else incoming
    return torch.cat(chunks)


def blocking_ring_attention(ctx, q, k, v):
    from labkit.exercises.context_parallel import partial_attention
    from labkit.parallel.context_parallel import merge_partials
    n, r = ctx.world_size, ctx.rank
    out, lse = partial_attention(q, k, v)
    for _ in range(n - 1):
        ctx.comm.send(k, (r + 1) % n)
        ctx.comm.send(v, (r + 1) % n)
        k, v = torch.empty_like(k), torch.empty_like(v)
        ctx.comm.recv(k, (r - 1) % n)
        ctx.comm.recv(v, (r - 1) % n)
        out, lse = merge_partials(out, lse, *partial_attention(q, k, v))
    return out


def world_average(ctx, mesh, grad):
    ctx.comm.all_reduce(grad)
    return grad / ctx.world_size


def summed_sync(ctx, model):
    for p in model.parameters():
        ctx.comm.all_reduce(p.grad)


def gathered_ring_attention(ctx, q, k, v):
    """Right values by a wasteful method: all-gather every K and V block, attend to all."""
    from labkit.exercises.context_parallel import partial_attention
    k_all = ctx.comm.all_gather(k.transpose(0, 1).contiguous())   # gathers along dim 0
    v_all = ctx.comm.all_gather(v.transpose(0, 1).contiguous())
    return partial_attention(q, k_all.transpose(0, 1), v_all.transpose(0, 1))[0]


def decode_without_cache(ctx, x, shard, cache, group):
    """Right values, no KV cache: keeps the inputs and recomputes k and v of every token."""
    import torch.nn.functional as F
    from labkit.models import causal_attention
    cache["x"] = torch.cat([cache["x"], x], dim=1) if "x" in cache else x
    q, k, v = F.linear(cache["x"], shard["w_qkv"], shard["b_qkv"]).chunk(3, dim=-1)
    cache["k"], cache["v"] = k, v                    # looks like a cache, is recomputed
    out = causal_attention(q, k, v, q.shape[-1] // shard["head_dim"])[:, -x.shape[1]:]
    partial = F.linear(out, shard["w_proj"])
    return ctx.comm.all_reduce(partial, group=group) + shard["b_proj"]


def detached_row_parallel(ctx, x_shard, weight_shard, bias, group):
    """Right values, outside autograd: the all-reduce of a detached partial sum."""
    import torch.nn.functional as F
    partial = F.linear(x_shard, weight_shard).detach()
    ctx.comm.all_reduce(partial, group=group)
    return partial + bias


def row_parallel_returns_none(ctx, x_shard, weight_shard, bias, group):
    import torch.nn.functional as F
    F.linear(x_shard, weight_shard)


def row_parallel_float64(ctx, x_shard, weight_shard, bias, group):
    """Right values in float64 (a learner's `.double()`): accepted, the dtype is no mistake."""
    from labkit.parallel.tensor_parallel import reduce_from_tp
    import torch.nn.functional as F
    return (reduce_from_tp(F.linear(x_shard, weight_shard), group, "x") + bias).double()
