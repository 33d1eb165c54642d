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
