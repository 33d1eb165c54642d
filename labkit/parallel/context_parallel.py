"""Context parallelism: the sequence split across ranks, keys and values passed around a ring.

The idea. Attention needs every query to meet every key, so splitting the sequence over N ranks
seems to need the whole sequence on each rank. It does not: softmax can be computed block by
block. Rank r keeps its own queries Q_r and, in N steps, sees the key/value block of every rank
as the blocks travel around the ring (send to r+1, receive from r-1). For each block it computes
the partial output O_b = softmax(Q_r K_b^T / sqrt(d)) V_b and its log-sum-exp
lse_b = log sum_j exp(s_j), and merges it into the running result by log-sum-exp
(the online softmax of Milakov & Gimelshein 2018, FlashAttention's merge):
    lse = log(exp(lse_a) + exp(lse_b));  O = exp(lse_a - lse) O_a + exp(lse_b - lse) O_b.
The backward passes K, V around the ring again; the gradients dK, dV of each block are partial
sums over the ranks' queries, so they travel with their block and come home after N hops.
Ring Attention: Liu, Zaharia & Abbeel 2023, arXiv 2310.01889.

The causal imbalance. With a causal mask and rank r holding the r-th contiguous chunk, rank r's
queries see only blocks 0..r: rank N-1 works ~2x the average while rank 0 idles. The zigzag
layout cuts the sequence into 2N chunks and gives rank r chunks r and 2N-1-r (one early, one
late): every rank then does the same work at every ring step (the layout of Llama 3 and of
ring-flash-attention; Striped Attention, Brandon et al. 2023, arXiv 2311.09431, balances it by
dealing the tokens out round-robin instead).

Memory per rank: q, k, v, out of s/N tokens (4 b h (s/N) d values) plus the fp32 log-sum-exp,
saved for backward; the s x s scores are never stored whole (one block of (s/N)^2 at a time).
Communication per rank and attention call (values of `dtype` bytes; KV = 2 b h (s/N) d):
forward (N-1) x KV sent; backward (N-1) x KV plus N x the dK, dV partial sums (in
`reduce_dtype`, fp32 by default: summing them in bf16 lets the rounding grow with N).
Each send overlaps the next block's computation when the block is large enough.

`all_gather_attention` is Llama 3's choice (Dubey et al. 2024, arXiv 2407.21783, sec. 3.3.2):
all-gather K and V (N-1 x KV per rank, not overlapped), attend, reduce-scatter dK, dV.
`ulysses_attention` is DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509): an all-to-all
trades sequence shards for head shards (each rank: h/N heads of the whole sequence), attention
runs as on one device, and an all-to-all trades back: (N-1)/N (q + k + v + out) of the shard
per rank each way, falling as 1/N; it needs N <= KV heads (h_kv divisible by N).

    x_local = shard_sequence(x, group, layout="zigzag", dim=1)   # do not forget the inputs
    out = ring_attention(q, k, v, group, causal=True, layout="zigzag")   # (b, heads, s/N, d)
    model = ContextParallel(model, group, layout="zigzag", method="ulysses",
                            attention=lambda m: isinstance(m, MyAttention))
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.overrides import TorchFunctionMode

from ..runtime.context import context

LAYOUTS = ("contiguous", "zigzag")
METHODS = ("ring", "all_gather")               # what the run driver offers (runs/)
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


def ring_attention(q, k, v, group=None, causal=True, layout="contiguous", scale=None,
                   reduce_dtype=torch.float32):
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


class _AllGatherSequence(torch.autograd.Function):
    """all_gather along the sequence forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(fctx, x, group, tag):
        fctx.group, fctx.tag = group, tag
        return context().comm.all_gather(x.movedim(SEQ_DIM, 0), group=group,
                                         tag=f"{tag} fwd").movedim(0, SEQ_DIM)

    @staticmethod
    def backward(fctx, grad):
        out = context().comm.reduce_scatter(grad.movedim(SEQ_DIM, 0), group=fctx.group,
                                            tag=f"{fctx.tag} bwd")
        return out.movedim(0, SEQ_DIM).contiguous(), None, None


def all_gather_attention(q, k, v, group=None, causal=True, layout="contiguous", scale=None):
    """The same result as `ring_attention`, Llama 3's way: all-gather K and V (one collective
    per tensor, not overlapped), attend with the mask of the layout's positions, and
    reduce-scatter dK, dV in backward."""
    group = _setup(q, k, v, group, layout)
    kv = _AllGatherSequence.apply(torch.stack((k, v), dim=1).flatten(1, 2).contiguous(),
                                  group, "all-gather attention kv")
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


# ---------------------------------------------------------------- applying it to a module

CORES = {"ring": ring_attention, "all_gather": all_gather_attention,
         "ulysses": ulysses_attention}


def _heads_last(core):
    """Adapt a (b, h, s, d) core to labkit's `causal_attention(q, k, v, heads)` convention:
    (batch, seq, heads * head_dim) in and out, always causal."""
    def causal_attention(q, k, v, heads):
        b, s, width = q.shape
        q, k, v = (t.view(b, s, heads, width // heads).transpose(1, 2) for t in (q, k, v))
        return core(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, width)
    return causal_attention


class _RouteAttention(TorchFunctionMode):
    """While active, a call of scaled_dot_product_attention (or of a core named in `cores`)
    goes to the context-parallel core; every other torch call runs as it is."""

    def __init__(self, core, cores):
        super().__init__()
        self.core, self.cores, self.depth = core, cores, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _sdpa:
            return self.core(*args, **kwargs)
        adapter = self.cores.get(func) or self.cores.get(getattr(func, "__name__", None))
        if adapter is not None:
            return adapter(self.core)(*args, **kwargs)
        return func(*args, **kwargs)

    def enter(self, *_):        # forward hooks of nested attention modules: enter once
        self.depth += 1
        if self.depth == 1:
            self.__enter__()

    def exit(self, *_):
        self.depth -= 1
        if self.depth == 0:
            self.__exit__(None, None, None)


class ContextParallel(nn.Module):
    """Run `module` on this rank's sequence shard with its attention made context-parallel.

    While the attention modules run (`attention`: None, the whole module; a module, a list, or
    a predicate `fn(module) -> bool` over `module.modules()`, as torchtitan picks its attention
    modules), a TorchFunctionMode routes every `F.scaled_dot_product_attention` call (however
    imported) to `method`'s core over the group: "ring", "all_gather" or "ulysses". Nothing is
    patched. A core of your own is routed too if it is overridable (calls
    `torch.overrides.handle_torch_function` when `has_torch_function`, as labkit's
    `models.causal_attention` does): `cores={fn_or_name: adapter}`, adapter(core) returning the
    replacement, `core(q, k, v, is_causal=...)` on (b, h, s_local, d). The other layers must be
    position-wise; shard the inputs with `shard_sequence`; average the replicated weights'
    gradients over the group (e.g. DataParallel).
    """

    def __init__(self, module, group=None, layout="contiguous", method="ring", cores=None,
                 attention=None):
        super().__init__()
        _check_layout(layout)
        if method not in CORES:
            raise ValueError(f"method must be one of {', '.join(CORES)}, got {method!r}")
        self.module, self.layout, self.method = module, layout, method
        self.group = context().group(group)
        cores = {"causal_attention": _heads_last} if cores is None else dict(cores)
        self._router = _RouteAttention(self.core, cores)
        self.attention = self._attention_modules(attention)
        self._hooks = [h for m in self.attention for h in (
            m.register_forward_pre_hook(self._router.enter),
            m.register_forward_hook(self._router.exit, always_call=True))]

    def _attention_modules(self, attention):
        if attention is None:
            return []                        # the whole forward (see `forward`)
        if isinstance(attention, nn.Module):
            attention = [attention]
        if callable(attention):
            chosen = [m for m in self.module.modules() if attention(m)]
        else:
            chosen = list(attention)
            inside = {id(m) for m in self.module.modules()}
            if any(id(m) not in inside for m in chosen):
                raise ValueError("attention= names a module that is not inside the wrapped one")
        if not chosen:
            raise ValueError(f"attention= selects no module of the {type(self.module).__name__}")
        return chosen

    def core(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             **extra):
        """scaled_dot_product_attention's signature, computed across the group."""
        if attn_mask is not None or dropout_p:
            raise ValueError("ContextParallel supports scaled_dot_product_attention without "
                             "attn_mask or dropout (use is_causal)")
        if q.shape[1] != k.shape[1] and not extra.get("enable_gqa"):
            raise ValueError("q and k have different head counts: pass enable_gqa=True")
        return CORES[self.method](q, k, v, self.group, causal=is_causal, layout=self.layout,
                                  scale=scale)

    def forward(self, *args, **kwargs):
        if self.attention:
            return self.module(*args, **kwargs)
        with self._router:
            return self.module(*args, **kwargs)

    def extra_repr(self):
        return f"group={list(self.group.ranks)}, layout={self.layout}, method={self.method}"
