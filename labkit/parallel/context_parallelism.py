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

    with context_parallel(mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1]):   # torch's
        loss = loss_fn(model(ids), labels)      # each buffer now this rank's zigzag shard
        loss.backward()                         # SDPA inside the block: ring attention
    x_local = shard_sequence(x, group, layout="zigzag", dim=1)   # do not forget the inputs
    out = ring_attention(q, k, v, group, causal=True, layout="zigzag")   # (b, heads, s/N, d)
    model = ContextParallel(model, group, layout="zigzag", method="ulysses",
                            attention=lambda m: isinstance(m, MyAttention))
    batch = context_parallel_batch(ids, labels, group, layout="zigzag")  # a whole causal LM
    loss = batch.loss(model(**batch.inputs).logits)      # positions, shifted labels, mean

`context_parallel(mesh, buffers, buffer_seq_dims)` is torch's front end
(torch.distributed.tensor.experimental.context_parallel): a context manager that shards the
buffers in place (zigzag, torch's head-tail load balancing), routes every SDPA call in the block
through the ring and restores the buffers on exit. The `ContextParallel` wrapper defaults to the
contiguous layout, as `shard_sequence` and `context_parallel_batch` do: the wrapper's layout must
match the one its caller shards with, and the lesson starts from the contiguous split to show
the causal imbalance; the context manager shards for itself, so it takes torch's default.

The cores live in `ring_attention.py` (ring, layouts, shards) and `head_attention.py`
(all-gather, Ulysses); this module applies them to a model (`ContextParallel`), and
`context_batch.py` shards a language model's batch (positions, labels shifted before sharding,
the batch's mean loss). An attention module that never reaches the core (eager, hand-written)
and a call the cores cannot run (an attn_mask) are refused in one line; on a wrapper's first
attention call on every rank at once (one all-reduce, once; a later call is refused by the
rank that meets the problem, and `launch` stops the others).
"""
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..runtime.comm import GroupLike
from ..runtime.context import context
from ..runtime.mesh import group_of
from .context_batch import (ContextParallelBatch, attn_mask_refusal, context_parallel_batch,
                            refuse_sequence_mixers)
from .head_attention import all_gather_attention, check_ulysses_heads, ulysses_attention
from .ring_attention import (LAYOUTS, SEQ_DIM, _check_layout, _sdpa, check_sequence,
                             gather_sequence, merge_partials, ring_attention,
                             sequence_positions, shard_sequence)
from .scoped_mode import ModuleScopedMode
from .self_check import check_against_one_device, is_hugging_face, logits_of, own_mean

__all__ = ["LAYOUTS", "METHODS", "SEQ_DIM", "CORES", "ContextParallel", "ContextParallelBatch",
           "context_parallel",
           "all_gather_attention", "context_parallel_batch",
           "check_sequence", "check_ulysses_heads", "gather_sequence", "merge_partials",
           "ring_attention", "sequence_positions", "shard_sequence", "ulysses_attention"]
METHODS = ("ring", "all_gather")   # the cores for any head count (Ulysses: N <= KV heads)

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


class _RouteAttention(ModuleScopedMode):
    """While active, a call of scaled_dot_product_attention (or of a core named in `cores`)
    goes to the context-parallel core; every other torch call runs as it is."""

    def __init__(self, core, cores):
        super().__init__()
        self.core, self.cores = core, cores
        self.routed = 0             # calls sent to the core so far (the attention check)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _sdpa:
            self.routed += 1
            return self.core(*args, **kwargs)
        adapter = self.cores.get(func) or self.cores.get(getattr(func, "__name__", None))
        if adapter is not None:
            self.routed += 1
            return adapter(self.core)(*args, **kwargs)
        return func(*args, **kwargs)



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
    position-wise; shard the inputs with `shard_sequence` (a causal LM: `context_parallel_batch`,
    which also gives its positions, shifted labels and loss); average the replicated weights'
    gradients over the group (e.g. DataParallel). Refused in one line (on the first attention
    call on every rank before any enters the ring; later, by the rank that meets it, whose
    error `launch` reports while it stops the others): an attention module that ran without
    a routed call (eager or hand-written attention), an attn_mask, dropout, a sliding window
    shorter than the sequence. verify: None (default) checks a Hugging Face model first: the
    same wrapper over a miniature of it, each rank its sequence shard (`context_parallel_batch`),
    must give one device's logits and gradients (self_check.py; cost, measured on 2 gloo ranks
    of a busy 2-core CPU: 0.06-0.15 s for a tiny Llama); True forces it, False skips it.
    """

    def __init__(self, module: nn.Module, group: GroupLike = None, layout: str = "contiguous",
                 method: str = "ring", cores: Mapping[Callable | str, Callable] | None = None,
                 attention: nn.Module | Iterable[nn.Module] | Callable[[nn.Module], bool]
                 | None = None, verify: bool | None = None) -> None:
        super().__init__()
        _check_layout(layout)
        refuse_sequence_mixers(module)   # a conv over the sequence would see only the shard
        if method not in CORES:
            raise ValueError(f"method must be one of {', '.join(CORES)}, got {method!r}")
        if verify or (verify is None and is_hugging_face(module)):
            _verify(module, context().group(group_of(group)), layout, method, cores, attention)
        self.module, self.layout, self.method = module, layout, method
        self.group = context().group(group_of(group))     # a group, or a 1-D DeviceMesh
        cores = {"causal_attention": _heads_last} if cores is None else dict(cores)
        self._router = _RouteAttention(self.core, cores)
        self._agreed = False        # whether the first call's all-reduce (`_agree`) has run
        self._window = _sliding_window(getattr(module, "config", None))
        self.attention = self._attention_modules(attention)
        self._hooks = [h for m in self.attention for h in (
            m.register_forward_pre_hook(self._router.enter),
            m.register_forward_hook(self._router.exit, always_call=True))]
        self._watch_attention()

    def _watch_attention(self):
        """Each attention module (the chosen ones, else those whose class is named
        *Attention*, outermost) must send at least one call to the core per forward: one that
        computes its scores by hand (eager attention, a hand-written softmax(QK^T)V) would
        otherwise attend within this rank's shard only, silently wrong."""
        watched = self.attention or _outermost(self.module, lambda m: "attention" in
                                               type(m).__name__.lower())
        names = {id(m): n or "the wrapped module" for n, m in self.module.named_modules()}
        self._entered, self._inside = {}, 0
        for m in watched:
            label = f"{type(m).__name__} ({names.get(id(m), '?')})"
            m.register_forward_pre_hook(self._enter_attention)
            m.register_forward_hook(lambda mod, _a, _o, label=label: self._check_routed(
                mod, label))

    def _enter_attention(self, module, _args):
        if self._inside or self._router.depth:    # routed now (not a run outside the wrapper)
            self._entered[id(module)] = self._router.routed

    def _check_routed(self, module, label):
        if self._router.routed == self._entered.pop(id(module), -1):
            raise ValueError(f"ContextParallel: {label} ran without calling "
                             "scaled_dot_product_attention (eager or hand-written attention), so "
                             "it attended within this rank's shard only: use an SDPA attention "
                             "(attn_implementation='sdpa') or route your core with cores=")

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
        problem, seq = None, q.shape[SEQ_DIM] * self.group.size
        if self._window is not None and seq > self._window:
            # transformers skips the window mask when each shard is within the window
            problem = (f"ContextParallel: the model attends within a sliding window of "
                       f"{self._window} tokens, shorter than the {seq}-token sequence; the "
                       "cores apply a full causal mask")
        elif attn_mask is not None:   # what the mask holds names the cause (context_batch)
            problem = attn_mask_refusal(attn_mask)
        elif dropout_p:
            problem = "ContextParallel: attention dropout is not supported (dropout_p=0)"
        elif q.shape[1] != k.shape[1] and not extra.get("enable_gqa"):
            problem = "q and k have different head counts: pass enable_gqa=True"
        if not self._agreed:
            self._agree(problem)
            self._agreed = True
        elif problem is not None:
            raise ValueError(problem)
        return CORES[self.method](q, k, v, self.group, causal=is_causal, layout=self.layout,
                                  scale=scale)

    def _agree(self, problem):
        """Every rank learns whether any rank cannot run this first call, before any enters
        the ring, so all refuse together instead of some waiting for a peer that raised (a
        packed batch's mask on one rank only, a model's sliding window). A one-int all_reduce,
        off the record (a guard, not the technique's traffic), once per wrapper: its latency
        on every attention call would only repeat the answer for the same shapes and model."""
        if self.group.size > 1:
            ctx = context()
            flag = torch.tensor([int(problem is not None)], device=ctx.device)
            with ctx.off_the_record():
                ctx.comm.all_reduce(flag, op="max", group=self.group,
                                    tag="context parallel: can every rank run this call?")
            if flag.item() and problem is None:
                problem = ("ContextParallel: another rank of the group cannot run this attention "
                           "call (see its error); stopped here so that no rank waits in the ring")
        if problem is not None:
            raise ValueError(problem)

    def forward(self, *args, **kwargs):
        if self.attention:
            return self.module(*args, **kwargs)
        self._inside += 1
        try:
            with self._router:
                return self.module(*args, **kwargs)
        finally:
            self._inside -= 1

    def extra_repr(self):
        return f"group={list(self.group.ranks)}, layout={self.layout}, method={self.method}"


def _verify(module, group, layout, method, cores, attention):
    """The self-check (self_check.py): the same wrapper over a miniature of `module`, each rank
    its shard of the sequence, the logits gathered in sequence order, against one device."""
    def apply(mini):
        chosen = attention
        if attention is not None and not callable(attention):   # modules: the same names
            names = {id(m): n for n, m in module.named_modules()}
            wanted = [names.get(id(m)) for m in
                      ([attention] if isinstance(attention, nn.Module) else attention)]
            chosen = [m for n, m in mini.named_modules() if n in wanted] or None
        return ContextParallel(mini, group, layout, method, cores, chosen, verify=False)

    def forward(model, ids):
        if not isinstance(model, ContextParallel):
            return model(ids)
        batch = context_parallel_batch(ids, None, group, layout)
        local = logits_of(model(**batch.inputs))
        return gather_sequence(own_mean(local, group.size), group, layout, dim=1)

    def gradients(model):   # each rank's share of a replicated weight's: averaged (as DDP)
        return {n: context().comm.all_reduce(p.grad.clone(), op="avg", group=group)
                for n, p in model.module.named_parameters() if p.grad is not None}
    check_against_one_device(module, apply, group, what="ContextParallel", forward=forward,
                             gradients=gradients)


@contextmanager
def context_parallel(mesh, buffers: Sequence[torch.Tensor] | None = None,
                     buffer_seq_dims: Sequence[int] | None = None,
                     no_restore_buffers: set | None = None, *, layout: str = "zigzag",
                     method: str = "ring"):
    """torch's `context_parallel` as a context manager: inside the block each of `buffers`
    (inputs, labels, positions: no parameter, nothing that requires grad) is this rank's shard
    along its `buffer_seq_dims` entry, in place, and every F.scaled_dot_product_attention call
    runs `method`'s core over the mesh's group (a 1-D DeviceMesh, labkit's or torch's, or a
    group); on exit the buffers get their whole sequence back (except `no_restore_buffers`).
    layout: "zigzag" (torch's default load balancing) or "contiguous". The wrapper's checks
    hold (one agreement on the first call, then one-line refusals)."""
    buffers = [] if buffers is None else list(buffers)
    seq_dims = [] if buffer_seq_dims is None else list(buffer_seq_dims)
    no_restore = [] if no_restore_buffers is None else list(no_restore_buffers)
    if len(buffers) != len(seq_dims):
        raise ValueError(f"context_parallel: {len(buffers)} buffers but {len(seq_dims)} "
                         "buffer_seq_dims (one sequence dim per buffer)")
    if any(not any(b is n for b in buffers) for n in no_restore):
        raise ValueError("context_parallel: no_restore_buffers must be a subset of buffers")
    if any(b.requires_grad for b in buffers):
        raise ValueError("context_parallel: a buffer requires grad (a parameter, or an "
                         "activation): shard only inputs, labels and positions")
    group = context().group(group_of(mesh))
    _check_layout(layout)
    restore = [None if any(b is n for n in no_restore) else b.clone() for b in buffers]
    for buffer, dim in zip(buffers, seq_dims):
        shard = shard_sequence(buffer, group, layout=layout, dim=dim).clone()
        buffer.resize_(shard.shape)
        buffer.copy_(shard)
    # the wrapper's router and checks, around no module: every SDPA call in the block
    router = ContextParallel(nn.Identity(), group, layout=layout, method=method)._router
    try:
        with router:
            yield
    finally:
        for buffer, whole in zip(buffers, restore):
            if whole is not None:
                buffer.resize_(whole.shape)
                buffer.copy_(whole)


def _sliding_window(config):
    """The window of a transformers config whose layers attend within one (None: none do)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None or (types is not None and "sliding_attention" not in types):
        return None
    return window if types is not None or getattr(config, "use_sliding_window", True) else None


def _outermost(module, chosen):
    """The modules under `module` (itself included) that `chosen` picks, none inside another."""
    found = []

    def visit(m):
        if chosen(m):
            found.append(m)
            return
        for child in m.children():
            visit(child)
    visit(module)
    return found
