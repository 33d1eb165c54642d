"""Ring attention: the sequence split across ranks, keys and values passed around a ring
(the core of context parallelism; `context_parallelism.py` tells the whole idea and applies it).

Rank r keeps its queries Q_r; in N steps the key/value block of every rank travels past it
(send to r+1, receive from r-1). Each block gives a partial output O_b and its log-sum-exp
lse_b, merged exactly (the online softmax of Milakov & Gimelshein 2018):
    lse = log(exp(lse_a) + exp(lse_b));  O = exp(lse_a - lse) O_a + exp(lse_b - lse) O_b.
Backward passes K, V around again; dK, dV partial sums travel with their block, home after N
hops. Per rank and call (KV = 2 b h (s/N) d values): forward (N-1) KV, backward (N-1) KV + N dKV
(in `reduce_dtype`, fp32 by default). Liu, Zaharia & Abbeel 2023, arXiv 2310.01889. Layouts:
contiguous, or zigzag (2N chunks, rank r holds r and 2N-1-r) to balance the causal mask.
Also here: the sequence layouts, `shard_sequence` / `gather_sequence`, and the helpers the other
cores share (`head_attention.py`).
"""
import math

import torch
import torch.nn.functional as F

from ..runtime.comm import GroupLike
from ..runtime.context import context

LAYOUTS = ("contiguous", "zigzag")
SEQ_DIM = 2                                     # q, k, v are (batch, heads, seq, head_dim)
_sdpa = F.scaled_dot_product_attention

# ------------------------------------------------------------------------ layouts and shards

def _chunks(rank, size, layout):
    """(chunk ids of `rank`, chunks the sequence is cut into)."""
    if layout == "contiguous":
        return [rank], size
    return [rank, 2 * size - 1 - rank], 2 * size


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def check_sequence(seq_len, size, layout):
    """One-line ValueError when a sequence of `seq_len` cannot be split for `size` ranks."""
    _check_layout(layout)
    parts = size if layout == "contiguous" else 2 * size
    if seq_len % parts:
        raise ValueError(f"sequence length {seq_len} is not divisible by {parts} (the "
                         f"{layout} layout over {size} ranks cuts it into {parts} equal chunks)")


def sequence_positions(seq_len, rank, size, layout="contiguous", device=None):
    """The global positions rank `rank` of `size` holds, in the order it holds them."""
    check_sequence(seq_len, size, layout)
    ids, parts = _chunks(rank, size, layout)
    c = seq_len // parts
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])


def shard_sequence(x, group=None, layout="contiguous", dim=1):
    """This rank's shard of `x` (the whole sequence, the same on every rank) along `dim`."""
    group = context().group(group)
    idx = sequence_positions(x.shape[dim], group.rank, group.size, layout, x.device)
    return x.index_select(dim, idx)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group, layout, dim):
        fctx.group, fctx.layout, fctx.dim = group, layout, dim
        pieces = context().comm.all_gather(x.movedim(dim, 0), group=group, tag="gather sequence")
        n, local = group.size, x.shape[dim]
        order = torch.cat([sequence_positions(n * local, r, n, layout) for r in range(n)])
        out = torch.empty_like(pieces)
        out[order] = pieces          # rank order -> global position order
        return out.movedim(0, dim)

    @staticmethod
    def backward(fctx, grad):
        # every rank computed the same thing from the gathered tensor: keep my positions' part
        return shard_sequence(grad, fctx.group, fctx.layout, fctx.dim), None, None, None


def gather_sequence(x, group=None, layout="contiguous", dim=1):
    """The whole sequence from every rank's shard along `dim`, in global order (all_gather)."""
    return _GatherSequence.apply(x, context().group(group), layout, dim)


# ----------------------------------------------------------------- blocks and their merge

def merge_partials(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys -> attention over both.

    out: (..., q, d); lse: (..., q), the log-sum-exp of each query's scores over its keys."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0)      # a row no key of a reached: weight 0
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0)
    return w_a.unsqueeze(-1) * out_a + w_b.unsqueeze(-1) * out_b, lse


def _block_plan(me, src, size, local, causal, layout, device):
    """What my queries do with the key/value block of rank `src`: (query rows, key columns,
    mask or None), or None when the causal mask hides the whole block (nothing to compute)."""
    everything = slice(0, local)
    if not causal:
        return everything, everything, None
    if src == me:     # the diagonal: my own positions on both sides
        pos = sequence_positions(local * size, me, size, layout, device)
        return everything, everything, pos.unsqueeze(1) >= pos.unsqueeze(0)
    if layout == "contiguous":
        return (everything, everything, None) if src < me else None
    half = local // 2  # zigzag: chunk src is before both of mine, chunk 2N-1-src after both
    if src < me:      # all my queries see the early half of its block, none the late half
        return everything, slice(0, half), None
    return slice(half, local), everything, None   # only my late chunk sees its block


def _scores(q, k, scale, mask):
    s = (q @ k.transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _repeat_heads(t, groups):
    """GQA: each K/V head serves `groups` query heads (dim 1); a view-free repeat."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_heads(t, groups):
    """The gradient of _repeat_heads: add the query heads that shared a K/V head."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


def _block_forward(q, k, v, scale, mask):
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


class _Ring:
    """A ring over the group: send to the next member, receive from the previous one."""

    def __init__(self, group):
        self.group, self.comm = group, context().comm
        self.next = (group.rank + 1) % group.size
        self.prev = (group.rank - 1) % group.size

    def pass_on(self, tensor, tag):
        """Async: send `tensor` on, receive the previous member's into a new buffer."""
        sent = self.comm.send(tensor, self.next, group=self.group, async_op=True, tag=tag)
        received = self.comm.recv(torch.empty_like(tensor), self.prev, group=self.group,
                                  async_op=True, tag=tag)
        return sent, received


def _wait(handles):
    sent, received = handles
    sent.wait()
    return received.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, group, causal, layout, scale, reduce_dtype):
        ctx, ring = context(), _Ring(group)
        n, me, local = group.size, group.rank, q.shape[SEQ_DIM]
        groups = q.shape[1] // k.shape[1]      # query heads per K/V head (GQA; 1: MHA)
        acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        qf = q.to(acc)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        for step in range(n):
            src = (me - step) % n
            pending = ring.pass_on(kv, "ring attention fwd kv") if step < n - 1 else None
            plan = _block_plan(me, src, n, local, causal, layout, q.device)
            if plan is not None:
                rows, cols, mask = plan
                with ctx.clock.compute("ring attention forward", block=src):
                    kb, vb = (_repeat_heads(t[:, :, cols].to(acc), groups) for t in kv)
                    o_b, lse_b = _block_forward(qf[:, :, rows], kb, vb, scale, mask)
                    out[:, :, rows], lse[:, :, rows] = merge_partials(
                        out[:, :, rows], lse[:, :, rows], o_b, lse_b)
            if pending is not None:
                kv = _wait(pending)
        out = out.to(q.dtype)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.setup = group, causal, layout, scale, reduce_dtype
        return out

    @staticmethod
    def backward(fctx, grad_out):
        q, k, v, out, lse = fctx.saved_tensors
        group, causal, layout, scale, reduce_dtype = fctx.setup
        ctx, ring = context(), _Ring(group)
        n, me, local = group.size, group.rank, q.shape[SEQ_DIM]
        groups = q.shape[1] // k.shape[1]
        acc = lse.dtype
        qf, do = q.to(acc), grad_out.to(acc)
        delta = (do * out.to(acc)).sum(-1, keepdim=True)   # D_i = dO_i . O_i
        dq = torch.zeros_like(qf)
        kv, dkv, dkv_pending = torch.stack((k, v)), None, None
        for step in range(n):
            src = (me - step) % n
            pending = ring.pass_on(kv, "ring attention bwd kv") if step < n - 1 else None
            plan = _block_plan(me, src, n, local, causal, layout, q.device)
            part = None
            if plan is not None:
                rows, cols, mask = plan
                with ctx.clock.compute("ring attention backward", block=src):
                    kb, vb = (_repeat_heads(t[:, :, cols].to(acc), groups) for t in kv)
                    qb, dob = qf[:, :, rows], do[:, :, rows]
                    p = torch.exp(_scores(qb, kb, scale, mask) - lse[:, :, rows].unsqueeze(-1))
                    dv_b = p.transpose(-2, -1) @ dob
                    ds = p * (dob @ vb.transpose(-2, -1) - delta[:, :, rows])
                    dq[:, :, rows] += (ds @ kb) * scale
                    dk_b = (ds.transpose(-2, -1) @ qb) * scale
                part = cols, _sum_heads(dk_b, groups), _sum_heads(dv_b, groups)
            # the dK, dV partial sums of block src arrive from the previous rank (step 0: none)
            dkv = (torch.zeros((2,) + k.shape, dtype=reduce_dtype, device=k.device)
                   if dkv_pending is None else _wait(dkv_pending))
            if part is not None:
                cols, dk_b, dv_b = part
                dkv[0][:, :, cols] += dk_b.to(reduce_dtype)
                dkv[1][:, :, cols] += dv_b.to(reduce_dtype)
            dkv_pending = ring.pass_on(dkv, "ring attention bwd dkv") if n > 1 else None
            if pending is not None:
                kv = _wait(pending)
        if n > 1:
            dkv = _wait(dkv_pending)   # after n hops my own block's sums are home
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)


def _check_qkv(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (batch, heads, local_seq, head_dim) tensors, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims mismatch: q has {q.shape[-1]}, k has {k.shape[-1]}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError("q, k, v must hold the same batch and local sequence (this rank's "
                         f"shard), k and v the same shape: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not share {k.shape[1]} key/value heads "
                         "evenly (grouped-query attention needs a multiple)")


def _setup(q, k, v, group, layout):
    _check_qkv(q, k, v)
    group = context().group(group)
    check_sequence(q.shape[SEQ_DIM] * group.size, group.size, layout)
    return group


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupLike = None,
                   causal: bool = True, layout: str = "contiguous", scale: float | None = None,
                   reduce_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """softmax(Q K^T * scale [causal]) V over the whole sequence, each rank holding its shard.

    q, k, v: (batch, heads, local_seq, head_dim), this rank's positions of the `layout`
    (k and v may have fewer heads, grouped-query attention: only those travel the ring)
    ("contiguous": chunk r of N; "zigzag": chunks r and 2N-1-r of 2N). Returns this rank's
    output rows. Blocks are computed in fp32 for bf16/fp16 inputs; K, V travel in their own
    dtype, the dK, dV partial sums in `reduce_dtype`.
    """
    group = _setup(q, k, v, group, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, causal, layout, scale, reduce_dtype)
