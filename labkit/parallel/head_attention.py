"""Context parallelism without a ring: two other ways to give every query every key.

`all_gather_attention` is Llama 3's choice (Dubey et al. 2024, arXiv 2407.21783, sec. 3.3.2):
all-gather K and V ((N-1) KV per rank, not overlapped), attend with the layout's causal mask,
reduce-scatter dK, dV in backward. Cheap with grouped-query attention (few KV heads).
`ulysses_attention` is DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509): an all-to-all
trades sequence shards for head shards (each rank: h/N heads of the whole sequence), attention
runs as on one device, and an all-to-all trades back: (N-1)/N (q + k + v + out) of the shard per
rank each way, falling as 1/N; it needs N <= KV heads (h_kv divisible by N).
Both return what `ring_attention` returns: (b, h, s/N, d) for this rank's queries.
"""
import torch

from ..runtime.context import context
from .mappings import gather_along
from .ring_attention import SEQ_DIM, _repeat_heads, _sdpa, _setup, sequence_positions


def all_gather_attention(q, k, v, group=None, causal=True, layout="contiguous", scale=None):
    """The same result as `ring_attention`, Llama 3's way: all-gather K and V (one collective
    per tensor, not overlapped), attend with the mask of the layout's positions, and
    reduce-scatter dK, dV in backward."""
    group = _setup(q, k, v, group, layout)
    kv = gather_along(torch.stack((k, v), dim=1).flatten(1, 2).contiguous(), group,
                      "all-gather attention kv", dim=SEQ_DIM)
    k_all, v_all = kv.unflatten(1, (2, k.shape[1])).unbind(1)
    mask = None
    if causal:
        n, s = group.size, q.shape[SEQ_DIM] * group.size
        mine = sequence_positions(s, group.rank, n, layout, q.device)
        keys = torch.cat([sequence_positions(s, r, n, layout, q.device) for r in range(n)])
        mask = mine.unsqueeze(1) >= keys.unsqueeze(0)
    groups = q.shape[1] // k.shape[1]
    with context().clock.compute("all-gather attention forward"):
        return _sdpa(q, _repeat_heads(k_all, groups), _repeat_heads(v_all, groups),
                     attn_mask=mask, scale=scale)


# ----------------------------------------------------------- Ulysses: all-to-all over heads

def check_ulysses_heads(heads, kv_heads, size):
    """One-line ValueError unless the heads split evenly over `size` ranks (Ulysses' limit)."""
    if kv_heads % size or heads % size:
        raise ValueError(f"Ulysses splits the heads over the group: {heads} query and {kv_heads} "
                         f"key/value heads do not split over {size} ranks (it needs N <= KV "
                         "heads, dividing them); use method 'ring' or 'all_gather'")


def _heads_for_sequence(x, group, tag, to_heads):
    """all_to_all: (b, h, s/N, d) sequence shards <-> (b, h/N, s, d) head shards, the sequence
    in rank order (rank 0's positions, then rank 1's, ...)."""
    n = group.size
    if to_heads:       # slice j of dim 0: the heads of rank j; back: rank j's tokens
        b, h, local, d = x.shape
        send = x.reshape(b, n, h // n, local, d).movedim(1, 0)
    else:
        b, hn, s, d = x.shape
        send = x.reshape(b, hn, n, s // n, d).movedim(2, 0)
    got = context().comm.all_to_all(send.contiguous(), group=group, tag=tag)
    if to_heads:
        return got.movedim(0, 2).reshape(b, h // n, n * local, d)
    return got.movedim(0, 1).reshape(b, n * hn, s // n, d)


class _AllToAllHeads(torch.autograd.Function):
    """The exchange forward; the inverse exchange of the gradient backward."""

    @staticmethod
    def forward(fctx, x, group, tag, to_heads):
        fctx.setup = group, tag, to_heads
        return _heads_for_sequence(x, group, f"{tag} fwd", to_heads)

    @staticmethod
    def backward(fctx, grad):
        group, tag, to_heads = fctx.setup
        return _heads_for_sequence(grad, group, f"{tag} bwd", not to_heads), None, None, None


def ulysses_attention(q, k, v, group=None, causal=True, layout="contiguous", scale=None):
    """The same result as `ring_attention`, DeepSpeed-Ulysses' way (Jacobs et al. 2023, arXiv
    2309.14509): all-to-all q, k, v so that each rank holds h/N whole heads of the whole
    sequence, attend (one device's attention, fp32 blocks for bf16), all-to-all the output back
    to sequence shards. Per rank and call, forward (N-1)/N (q + k + v + out) of its shard, the
    same backward: 1/N of ring's volume per token. Needs h_kv divisible by N (N <= KV heads)."""
    group = _setup(q, k, v, group, layout)
    n = group.size
    check_ulysses_heads(q.shape[1], k.shape[1], n)
    if n > 1:
        q = _AllToAllHeads.apply(q, group, "ulysses attention q", True)
        kv = _AllToAllHeads.apply(torch.cat((k, v), dim=-1), group, "ulysses attention kv", True)
        k, v = kv.chunk(2, dim=-1)
    s = q.shape[SEQ_DIM]
    positions = torch.cat([sequence_positions(s, r, n, layout, q.device) for r in range(n)])
    mask = positions.unsqueeze(1) >= positions.unsqueeze(0) if causal else None
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    groups = q.shape[1] // k.shape[1]
    with context().clock.compute("ulysses attention forward"):
        out = _sdpa(q.to(acc), _repeat_heads(k.to(acc), groups), _repeat_heads(v.to(acc), groups),
                    attn_mask=mask, scale=scale).to(q.dtype)
    return _AllToAllHeads.apply(out, group, "ulysses attention out", False) if n > 1 else out
