"""The autograd collectives the techniques are built from, in one place (Megatron-LM's
`mappings.py`, Shoeybi et al. 2019, arXiv 1909.08053).

A parallel layer is correct only if its backward communicates the *conjugate* of its forward:
what one rank adds up forward, every rank receives backward, and the other way round. Each
operator below is one such pair; a technique calls them where its collectives belong, so the
lesson's collectives stay visible in the technique's own code:

| operator              | forward                       | backward                         |
|-----------------------|-------------------------------|----------------------------------|
| `copy_to`       (f)   | identity                      | all-reduce (sum the partial grads)|
| `reduce_from`   (g)   | all-reduce (sum partial outs) | identity                         |
| `gather_along`        | all-gather along `dim`        | reduce-scatter along `dim`       |
| `scatter_along`       | reduce-scatter along `dim`    | all-gather along `dim`           |
| `gather_keep_slice`   | all-gather along `dim`        | keep this rank's slice           |
| `all_to_all_rows`     | rows to their owners (splits) | gradients back (splits swapped)  |

Tensor parallelism uses f and g (and, with sequence parallelism, gather/scatter along the
sequence, dim -2); all-gather context parallelism gathers K and V along the sequence; expert
parallelism sends token rows to their experts and back. Bytes per rank for a tensor of S bytes
over N ranks (the ring model): all-reduce 2(N-1)/N S; all-gather and reduce-scatter (N-1)/N S
of the gathered size; all-to-all (N-1)/N of the rows sent. Each call is logged by `ctx.comm`
under `tag` + " fwd" / " bwd".
"""
import torch

from ..runtime.comm import GroupLike
from ..runtime.context import context

SEQUENCE_DIM = -2           # (..., s, h): sequence parallelism splits the tokens


# --------------------------------------------------------------- collectives along one dim
# ctx.comm gathers and scatters along dim 0: move the wanted dim there and back.

def all_gather_dim(x, dim, group, tag):
    """All-gather `x` along `dim` (no autograd)."""
    return context().comm.all_gather(x.movedim(dim, 0), group=group, tag=tag).movedim(0, dim)


def reduce_scatter_dim(x, dim, group, tag):
    """Sum over the group and keep this rank's part along `dim` (no autograd)."""
    out = context().comm.reduce_scatter(x.movedim(dim, 0), group=group, tag=tag)
    return out.movedim(0, dim).contiguous()


def all_reduce_copy(x, group, tag):
    """All-reduce a contiguous copy: the input of an autograd Function must not change in place."""
    return context().comm.all_reduce(x.clone(memory_format=torch.contiguous_format),
                                     group=group, tag=tag)


# --------------------------------------------------------------- the conjugate pairs

class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group, tag):
        fctx.group, fctx.tag = group, tag
        return x.view_as(x)

    @staticmethod
    def backward(fctx, grad):
        return all_reduce_copy(grad, fctx.group, f"{fctx.tag} bwd"), None, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group, tag):
        return all_reduce_copy(x, group, f"{tag} fwd")

    @staticmethod
    def backward(fctx, grad):
        return grad, None, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group, tag, dim):
        fctx.group, fctx.tag, fctx.dim = group, tag, dim
        return all_gather_dim(x, dim, group, f"{tag} fwd")

    @staticmethod
    def backward(fctx, grad):
        grad = reduce_scatter_dim(grad, fctx.dim, fctx.group, f"{fctx.tag} bwd")
        return grad, None, None, None


class _ScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group, tag, dim):
        fctx.group, fctx.tag, fctx.dim = group, tag, dim
        return reduce_scatter_dim(x, dim, group, f"{tag} fwd")

    @staticmethod
    def backward(fctx, grad):
        return all_gather_dim(grad, fctx.dim, fctx.group, f"{fctx.tag} bwd"), None, None, None


class _GatherKeepSlice(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group, tag, dim):
        fctx.group, fctx.dim = group, dim
        return all_gather_dim(x, dim, group, f"{tag} fwd")

    @staticmethod
    def backward(fctx, grad):
        mine = grad.chunk(fctx.group.size, dim=fctx.dim)[fctx.group.rank]
        return mine.contiguous(), None, None, None


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(fctx, rows, group, send, recv, tag):
        fctx.route = (group, send, recv, tag)
        return context().comm.all_to_all(rows, input_splits=send, output_splits=recv,
                                         group=group, tag=tag)

    @staticmethod
    def backward(fctx, grad):
        group, send, recv, tag = fctx.route
        back = context().comm.all_to_all(grad.contiguous(), input_splits=recv,
                                         output_splits=send, group=group, tag=f"{tag} bwd")
        return back, None, None, None, None


# --------------------------------------------------------------- the operators
# group: None (the world), a labkit Group or a torch process group.

def copy_to(x, group: GroupLike = None, tag=""):
    """f: identity forward; all-reduce backward (each rank's gradient is one part of the sum)."""
    return _CopyTo.apply(x, context().group(group), tag)


def reduce_from(x, group: GroupLike = None, tag=""):
    """g: all-reduce forward (sum the partial outputs); identity backward."""
    return _ReduceFrom.apply(x, context().group(group), tag)


def gather_along(x, group: GroupLike = None, tag="", dim=SEQUENCE_DIM):
    """All-gather the shards along `dim` forward; reduce-scatter the gradient backward."""
    return _GatherAlong.apply(x, context().group(group), tag, dim)


def scatter_along(x, group: GroupLike = None, tag="", dim=SEQUENCE_DIM):
    """Reduce-scatter the partial sums along `dim` forward; all-gather the gradient backward."""
    return _ScatterAlong.apply(x, context().group(group), tag, dim)


def gather_keep_slice(x, group: GroupLike = None, tag="", dim=-1):
    """All-gather along `dim` forward; backward keeps this rank's slice (every rank computed
    the same thing from the gathered tensor)."""
    return _GatherKeepSlice.apply(x, context().group(group), tag, dim)


def all_to_all_rows(rows, group, send, recv, tag=""):
    """Rows [sum(send[:i]), sum(send[:i+1])) go to group member i; recv[i] rows come from it.
    Backward sends the gradients back the way the rows came: the same op, splits swapped."""
    return _AllToAllRows.apply(rows, group, send, recv, tag)
