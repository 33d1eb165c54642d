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
    from labkit.parallel.context_parallelism import merge_partials
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


# ---------------------------------------------- a catalog per code exercise: (answer, problem)

def _no_recv(ctx, tensor):
    if ctx.rank == 0:
        ctx.comm.send(tensor, 1)
    elif ctx.rank == 1:
        ctx.comm.recv(tensor, 0)
    return tensor


def _broadcast_collective(ctx, tensor):
    ctx.comm.broadcast(tensor, 0)
    return tensor


def _ring_averaged(ctx, tensor):
    return ring_ok(ctx, tensor) / ctx.world_size


def _ring_reduce_scatter_only(ctx, tensor):
    return ring_ok(ctx, tensor, gather=False)


def _ring_by_all_reduce(ctx, tensor):
    ctx.comm.all_reduce(tensor)
    return tensor


def _ring_whole_tensors(ctx, tensor):
    """Right sums, but the whole tensor passes round the ring N-1 times."""
    n, r, total, passing = ctx.world_size, ctx.rank, tensor.clone(), tensor.clone()
    for _ in range(n - 1):
        handle = ctx.comm.send(passing, (r + 1) % n, async_op=True)
        incoming = torch.empty_like(passing)
        ctx.comm.recv(incoming, (r - 1) % n)
        handle.wait()
        passing = incoming
        total += incoming
    return total


def ring_ok(ctx, tensor, gather=True):
    n, r = ctx.world_size, ctx.rank
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    phases = [(0, True), (1, False)] if gather else [(0, True)]
    for shift, add in phases:
        for s in range(n - 1):
            send_i, recv_i = ((r - s) % n, (r - s - 1) % n) if add else \
                ((r + 1 - s) % n, (r - s) % n)
            incoming = torch.empty_like(chunks[recv_i])
            handle = ctx.comm.send(chunks[send_i], (r + 1) % n, async_op=True)
            ctx.comm.recv(incoming, (r - 1) % n)
            handle.wait()
            chunks[recv_i] += incoming if add else incoming - chunks[recv_i]
    return tensor


def _row_no_sum(ctx, x_shard, weight_shard, bias, group):
    return torch.nn.functional.linear(x_shard, weight_shard, bias)


def _row_bias_each_rank(ctx, x_shard, weight_shard, bias, group):
    from labkit.parallel.tensor_parallel import reduce_from_tp
    return reduce_from_tp(torch.nn.functional.linear(x_shard, weight_shard, bias), group, "x")


def _row_averaged(ctx, x_shard, weight_shard, bias, group):
    from labkit.parallel.tensor_parallel import reduce_from_tp
    partial = torch.nn.functional.linear(x_shard, weight_shard)
    return reduce_from_tp(partial, group, "x") / ctx.world_size + bias


def _row_concatenated(ctx, x_shard, weight_shard, bias, group):
    partial = torch.nn.functional.linear(x_shard, weight_shard)
    return ctx.comm.all_gather(partial.t().contiguous()).t() + 0


def _shard_whole(ctx, grad):
    ctx.comm.all_reduce(grad)
    return grad / ctx.world_size


def _shard_wrong_slice(ctx, grad):
    mine = ctx.comm.reduce_scatter(grad) / ctx.world_size
    return ctx.comm.all_gather(mine).chunk(ctx.world_size)[(ctx.rank + 1) % ctx.world_size]


def _shard_unreduced(ctx, grad):
    return grad.chunk(ctx.world_size)[ctx.rank]


def _mesh_world_sum_average(ctx, mesh, grad):
    ctx.comm.all_reduce(grad, group=mesh["dp"])
    return grad


def _mesh_tp(ctx, mesh, grad):
    ctx.comm.all_reduce(grad, group=mesh["tp"])
    return grad / mesh["tp"].size


def _sync_nothing(ctx, model):
    pass


def _sync_twice_divided(ctx, model):
    for p in model.parameters():
        ctx.comm.all_reduce(p.grad)
        p.grad /= ctx.world_size ** 2


def _own_keys_only(ctx, q, k, v):
    from labkit.exercises.context_parallel import partial_attention
    return partial_attention(q, k, v)[0]


def _ring_one_pass_too_many(ctx, q, k, v):
    from labkit.exercises.context_parallel import partial_attention
    from labkit.parallel.context_parallelism import merge_partials
    n, r = ctx.world_size, ctx.rank
    out, lse = partial_attention(q, k, v)
    for step in range(n):                                # N passes: the last brings k, v back
        sends = [ctx.comm.send(t, (r + 1) % n, async_op=True) for t in (k, v)]
        k_in, v_in = torch.empty_like(k), torch.empty_like(v)
        ctx.comm.recv(k_in, (r - 1) % n)
        ctx.comm.recv(v_in, (r - 1) % n)
        for handle in sends:
            handle.wait()
        k, v = k_in, v_in
        if step < n - 1:
            out, lse = merge_partials(out, lse, *partial_attention(q, k, v))
    return out


def _decode_parts(x, shard, cache, keep=True):
    import torch.nn.functional as F
    from labkit.models import causal_attention
    q, k, v = F.linear(x, shard["w_qkv"], shard["b_qkv"]).chunk(3, dim=-1)
    if "k" in cache:
        k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
    if keep:
        cache["k"], cache["v"] = k, v
    out = causal_attention(q, k, v, q.shape[-1] // shard["head_dim"])
    return F.linear(out, shard["w_proj"])


def _decode_no_all_reduce(ctx, x, shard, cache, group):
    return _decode_parts(x, shard, cache) + shard["b_proj"]


def _decode_bias_each_rank(ctx, x, shard, cache, group):
    return ctx.comm.all_reduce(_decode_parts(x, shard, cache) + shard["b_proj"], group=group)


def _decode_cache_not_kept(ctx, x, shard, cache, group):
    partial = _decode_parts(x, shard, cache, keep="k" not in cache)   # the prompt only
    return ctx.comm.all_reduce(partial, group=group) + shard["b_proj"]


def _decode_two_reduces(ctx, x, shard, cache, group):
    partial = _decode_parts(x, shard, cache)
    ctx.comm.all_reduce(torch.zeros(1), group=group)
    return ctx.comm.all_reduce(partial, group=group) + shard["b_proj"]


def code_catalog():
    """{exercise: (checker name, [(wrong answer, the problem it must be named as)])}."""
    return {
        "00-1": ("why_parallelism.check_broadcast", [(_no_recv, "not received"),
                                                     (_broadcast_collective, "collective")]),
        "01-1": ("data_parallel.check_ring_all_reduce", [
            (_ring_averaged, "wrong sum"), (_ring_reduce_scatter_only, "wrong chunk"),
            (lambda ctx, tensor: tensor * ctx.world_size, "same data"),
            (_ring_by_all_reduce, "not a ring"), (_ring_whole_tensors, "too many bytes")]),
        "03-1": ("tensor_parallel.check_row_parallel", [
            (_row_no_sum, "no sum"), (_row_bias_each_rank, "bias"), (_row_averaged, "averaged"),
            (_row_concatenated, "shape"), (detached_row_parallel, "detached")]),
        "04-1": ("zero.check_gradient_shard", [
            (summed_shard, "summed"), (all_reduce_then_slice, "too many bytes"),
            (_shard_whole, "whole gradient"), (_shard_wrong_slice, "wrong slice"),
            (_shard_unreduced, "not reduced")]),
        "06-1": ("hybrid.check_dp_average", [
            (world_average, "world"), (_mesh_world_sum_average, "summed"),
            (_mesh_tp, "tp group")]),
        "07-1": ("when_it_breaks.check_gradient_sync", [
            (summed_sync, "summed"), (_sync_nothing, "replicas differ"),
            (_sync_twice_divided, "wrong result")]),
        "08-2": ("context_parallel.check_ring_attention", [
            (_own_keys_only, "no ring"), (gathered_ring_attention, "not a ring"),
            (_ring_one_pass_too_many, "one pass too many")]),
        "09-1": ("serving.check_tp_decode_step", [
            (_decode_no_all_reduce, "no all-reduce"), (_decode_bias_each_rank, "bias summed"),
            (decode_without_cache, "no cache"), (_decode_cache_not_kept, "cache"),
            (_decode_two_reduces, "too many collectives")]),
    }
