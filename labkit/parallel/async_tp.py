"""Async tensor parallelism: hide the sequence all-gather and reduce-scatter under the matmul.

With sequence parallelism (tensor_parallel.py) a colwise layer all-gathers its input's sequence
shards before its matmul and a rowwise layer reduce-scatters its partial sums after it: the
matmul waits for the link, then the link waits for the matmul. A ring collective is t-1 steps
of one chunk each; doing the matmul chunk by chunk, in the ring's order, lets each step's
message travel while the previous chunk multiplies ("collective matmul": Wang et al. 2023,
ASPLOS, "Overlap communication with dependent computation via decomposition in large deep
learning models"; PyTorch's async TP is the same decomposition on symmetric memory,
torch.distributed._symmetric_memory.fused_all_gather_matmul / fused_matmul_reduce_scatter).

- all-gather matmul (colwise, Y = gather(X) A_i^T): at step k rank r holds the sequence chunk
  of rank r-k; it passes that chunk on to r+1 (and receives the next one from r-1) while it
  multiplies it. t matmuls, t-1 messages of one chunk: the all-gather's (t-1) * chunk bytes.
- matmul reduce-scatter (rowwise, Y_r = sum_i X_i[chunk r] A_i^T): at step k rank r multiplies
  chunk r+k+1, adds the running sum received from r+1 and passes it on to r-1; after t steps
  the sum of chunk r has visited every rank and ends here. t-1 messages of one chunk: the
  reduce-scatter's (t-1)/t of the full partial sums.
Each is the other's backward (the dual ring): an all-gather's gradient is a reduce-scatter of
the gradient and vice versa; the weight gradient is summed chunk by chunk in the same steps.
Communication: the same bytes as the plain collectives, in t-1 messages per ring; hidden when
one chunk's matmul (2 b (s/t) h_in h_out / t FLOPs) takes longer than one chunk's message.
Memory: with `regather` (the lab's default) a colwise layer keeps only its input's shard and
gathers it again in backward, in a ring beside the reduce-scatter ring (Korthikanti et al. 2022
sec. 4.2.2: s/t of the activation for one more all-gather's bytes); without, the gathered input
(as torch's fused op returns it).
"""
import torch
import torch.nn.functional as F

from ..runtime.context import context
from .mappings import SEQUENCE_DIM   # (..., s, h): the chunks are sequence shards



def _chunk(x, index, size):
    return x.narrow(SEQUENCE_DIM, index * size, size)


def _start_exchange(chunk, to, source, group, tag):
    """Send `chunk` to member `to` and receive one like it from member `source`, both async:
    (send handle, receive handle); the ring step's message."""
    comm = context().comm
    received = torch.empty_like(chunk)
    receive = comm.recv(received, source, group=group, async_op=True, tag=tag)
    send = comm.send(chunk, to, group=group, async_op=True, tag=tag)
    return send, receive


def ring_all_gather(shard, visit, group, tag=""):
    """All-gather `shard` over `group` as a ring of sends, calling visit(chunk, member) on each
    member's chunk (this rank's first) while the next chunk travels."""
    n, me = group.size, group.rank
    held, owner = shard.contiguous(), me
    for step in range(n):
        pending = None
        if step < n - 1:   # pass the held chunk on to the next member, get the previous one's
            pending = _start_exchange(held, (me + 1) % n, (me - 1) % n, group, tag)
        visit(held, owner)                 # the matmul that hides the message
        if pending is not None:
            send, receive = pending
            held, owner = receive.wait(), (owner - 1) % n
            send.wait()
    return shard


def ring_reduce_scatter(partial, group, tag=""):
    """Reduce-scatter as a ring: partial(c) computes this rank's partial sum for sequence chunk c
    of the group, while the running sum of the previous chunk travels; returns this rank's
    chunk, summed over the group."""
    n, me = group.size, group.rank
    total = partial((me + 1) % n)
    for step in range(1, n):
        send, receive = _start_exchange(total, (me - 1) % n, (me + 1) % n, group, tag)
        mine = partial((me + step + 1) % n)   # the matmul that hides the message
        total = receive.wait() + mine
        send.wait()
    return total


def ring_all_gather_and_reduce_scatter(shard, visit, partial, group, tags=("", "")):
    """Both rings at once, one step of each per chunk: visit(chunk, member) on every member's
    chunk of `shard` (as ring_all_gather) and partial(c) summed as ring_reduce_scatter, whose
    result it returns. The backward of a colwise layer that kept only its input's shard."""
    n, me = group.size, group.rank
    held, owner, total = shard.contiguous(), me, None
    for step in range(n):
        gather = scatter = None
        if step < n - 1:
            gather = _start_exchange(held, (me + 1) % n, (me - 1) % n, group, tags[0])
        if step > 0:
            scatter = _start_exchange(total, (me - 1) % n, (me + 1) % n, group, tags[1])
        visit(held, owner)
        mine = partial((me + step + 1) % n)     # both matmuls hide both messages
        total = mine if scatter is None else scatter[1].wait() + mine
        for pending in (scatter, gather):
            if pending is not None:
                pending[0].wait()
        if gather is not None:
            held, owner = gather[1].wait(), (owner - 1) % n
    return total


def _sum_dtype(dtype):
    """Weight gradients are summed over chunks in at least float32 (bf16 chunks round once each
    before the sum, as one whole matmul rounds its sum once)."""
    return torch.promote_types(dtype, torch.float32)


def _rows(t):
    return t.reshape(-1, t.shape[-1])


class AllGatherLinear(torch.autograd.Function):
    """F.linear(all_gather(x along the sequence), weight, bias), the gather done as a ring under
    the chunk matmuls; backward: the input gradient reduce-scattered as a ring under its chunk
    matmuls, the weight gradient summed chunk by chunk in the same steps. `regather`: keep only
    the shard x for backward and all-gather it again there, in a ring beside the other."""

    @staticmethod
    def forward(fctx, x, weight, bias, group, tag, regather):
        size, n = x.shape[SEQUENCE_DIM], group.size
        lead = x.shape[:SEQUENCE_DIM]
        out = x.new_empty(lead + (n * size, weight.shape[0]))
        gathered = None if regather else x.new_empty(lead + (n * size, x.shape[-1]))

        def visit(chunk, owner):
            if gathered is not None:
                _chunk(gathered, owner, size).copy_(chunk)
            _chunk(out, owner, size).copy_(F.linear(chunk, weight, bias))
        ring_all_gather(x, visit, group, f"{tag} fwd (ring all-gather)")
        fctx.save_for_backward(x if regather else gathered, weight)
        fctx.group, fctx.tag, fctx.size, fctx.has_bias = group, tag, size, bias is not None
        fctx.regather = regather
        return out

    @staticmethod
    def backward(fctx, grad):
        kept, weight = fctx.saved_tensors
        grad, size, group, tag = grad.contiguous(), fctx.size, fctx.group, fctx.tag
        grad_weight = weight.new_zeros(weight.shape, dtype=_sum_dtype(weight.dtype))

        def add_weight_grad(chunk, owner):   # chunk: member owner's piece of the input
            g = _chunk(grad, owner, size)
            grad_weight.add_(_rows(g).t() @ _rows(chunk))

        def input_grad(c):
            return _chunk(grad, c, size) @ weight
        scatter_tag, gather_tag = f"{tag} bwd (ring reduce-scatter)", f"{tag} bwd (regather)"
        wants_input = fctx.needs_input_grad[0]
        if not fctx.regather:
            for c in range(group.size):     # the gathered input is here: chunk by chunk
                add_weight_grad(_chunk(kept, c, size), c)
            grad_x = ring_reduce_scatter(input_grad, group, scatter_tag) if wants_input \
                else None
        elif wants_input:
            grad_x = ring_all_gather_and_reduce_scatter(kept, add_weight_grad, input_grad,
                                                        group, (gather_tag, scatter_tag))
        else:   # the input is data: no input gradient, only the weight's (regathered)
            ring_all_gather(kept, add_weight_grad, group, gather_tag)
            grad_x = None
        grad_bias = _rows(grad).sum(dim=0) if fctx.has_bias else None
        return grad_x, grad_weight.to(weight.dtype), grad_bias, None, None, None


class LinearReduceScatter(torch.autograd.Function):
    """reduce_scatter(F.linear(x, weight) along the sequence), the sum done as a ring under the
    chunk matmuls; backward: the output gradient all-gathered as a ring under the input- and
    weight-gradient matmuls of each chunk."""

    @staticmethod
    def forward(fctx, x, weight, group, tag):
        n, full = group.size, x.shape[SEQUENCE_DIM]
        if full % n:
            raise ValueError(f"async TP: the sequence ({full} tokens) must divide by the TP "
                             f"degree ({n}); each rank keeps a chunk of s/t")
        size = full // n
        total = ring_reduce_scatter(lambda c: F.linear(_chunk(x, c, size), weight), group,
                                    f"{tag} fwd (ring reduce-scatter)")
        fctx.save_for_backward(x, weight)
        fctx.group, fctx.tag, fctx.size = group, tag, size
        return total

    @staticmethod
    def backward(fctx, grad):
        x, weight = fctx.saved_tensors
        size = fctx.size
        grad_x = torch.empty_like(x)
        grad_weight = weight.new_zeros(weight.shape, dtype=_sum_dtype(weight.dtype))

        def visit(g, owner):
            _chunk(grad_x, owner, size).copy_(g @ weight)
            grad_weight.add_(_rows(g).t() @ _rows(_chunk(x, owner, size)))
        ring_all_gather(grad, visit, fctx.group, f"{fctx.tag} bwd (ring all-gather)")
        return grad_x, grad_weight.to(weight.dtype), None, None


def all_gather_linear(x, weight, bias=None, group=None, tag="", regather=True):
    """Y = F.linear(all_gather(x, sequence dim), weight, bias) with the gather hidden under the
    chunk matmuls (x: this rank's (..., s/t, h_in) sequence shard). regather: keep only x for
    backward and gather it again there (False: keep the gathered input)."""
    return AllGatherLinear.apply(x, weight, bias, context().group(group), tag, regather)


def linear_reduce_scatter(x, weight, group=None, tag=""):
    """reduce_scatter(F.linear(x, weight), sequence dim) with the sum hidden under the chunk
    matmuls (x: the whole (..., s, h_in/t) input; returns this rank's (..., s/t, h_out))."""
    return LinearReduceScatter.apply(x, weight, context().group(group), tag)
