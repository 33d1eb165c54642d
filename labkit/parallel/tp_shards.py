"""How tensor parallelism cuts a parameter and puts it back together.

Each split parameter remembers its cut, `tp_split = (dim, parts)`: the axis (0 for a Linear's
output features, 1 for its input features; the other way round for GPT-2's Conv1D, whose
weight is stored (in, out)) and, for a fused projection, the parts cut one by one (q|k|v:
their sizes), so that rank i holds slice i of each part. `gather_params` / `gather_grads`
all-gather the slices of each part along that axis and concatenate the parts: the whole
tensor under its original name, to compare with one device.
"""
import torch
import torch.nn as nn

from .mappings import all_gather_dim


def split_parts(tensor, dim, parts, divide=1):
    """`tensor` cut along `dim` into `parts` (an int: equal parts; a tuple: the whole tensor's
    part sizes, each / `divide` on a shard)."""
    if isinstance(parts, int):
        return tensor.chunk(parts, dim=dim)
    return tensor.split([p // divide for p in parts], dim=dim)


def shard(param, group, dim, parts=1, shared=None):
    """This rank's slice of `param` along `dim` as a new Parameter; with parts (fused q|k|v:
    3 or their sizes) the slice of each part, concatenated, so the local tensor keeps the
    q|k|v layout. `shared` ({id(original): shard}) keeps tied weights tied: a weight seen
    twice gets one shard."""
    if param is None:
        return None
    known = shared.get(id(param)) if shared is not None else None
    if known is not None:
        if known.tp_split != (dim, parts):
            raise ValueError("a tied weight is split two different ways by the plan")
        return known
    pieces = split_parts(param.detach(), dim, parts)
    mine = [p.chunk(group.size, dim=dim)[group.rank] for p in pieces]
    shard = nn.Parameter(torch.cat(mine, dim=dim).clone(), requires_grad=param.requires_grad)
    shard.tp_split, shard.tp_group = (dim, parts), group   # how gather_params rebuilds it
    if shared is not None:
        shared[id(param)] = shard
    return shard


def _full(tensor, param):
    split = getattr(param, "tp_split", None)
    if split is None:
        return tensor.detach().clone()
    dim, parts = split
    pieces = [all_gather_dim(p.detach(), dim, param.tp_group, "gather params")
              for p in split_parts(tensor, dim, parts, param.tp_group.size)]
    return torch.cat(pieces, dim=dim)


def gather_params(module):
    """{name: whole tensor} of every parameter under the original names (every rank of the
    group calls it: all-gathers; wrap it in `ctx.off_the_record()` to keep it out of the log)."""
    return {name: _full(p, p) for name, p in module.named_parameters()}


def gather_grads(module):
    """{name: whole gradient} like gather_params (parameters without a gradient left out)."""
    return {name: _full(p.grad, p) for name, p in module.named_parameters()
            if p.grad is not None}
