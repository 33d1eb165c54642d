"""Tensor parallelism: every weight matrix split across t ranks (Megatron-LM, Shoeybi et al. 2019).

A column-parallel linear splits output features (no comm), a row-parallel one splits input
features (partial sums, one all-reduce); MLP = column then row, attention = heads split. Per
block: 2 all-reduces of b*s*h forward, 2 backward; weights, grads, Adam state ~1/t. Sequence
parallelism (Korthikanti et al. 2022) shards the LayerNorm regions along the sequence: each
all-reduce becomes all-gather + reduce-scatter, and activations drop from
sbh(10 + 24/t + 5as/(ht)) to sbh/t (34 + 5as/h) bytes per layer.
"""
import copy
import math
import warnings
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import models
from .runs.reference import RunConfig, batch as global_batch, build_model, build_optimizer
from .theory import memory as theory_memory
from .theory import tensor_parallel as theory_tp

# ----------------------------------------------------------------- the conjugate operators
# Megatron's f and g: where the communication sits. Each takes the labkit ctx (so the call is
# logged and on the clock), the TP group and a tag naming the layer in the comm log.


def _collective(ctx, name, tensor, group, tag, **kwargs):
    previous, ctx.comm.tag = ctx.comm.tag, tag
    try:
        return getattr(ctx.comm, name)(tensor, group=group, **kwargs)
    finally:
        ctx.comm.tag = previous


def _gather_sequence(ctx, x, group, tag):
    """(b, s/t, h) shards of every rank -> (b, s, h): ctx.comm gathers along dim 0, so
    the sequence dimension goes first for the call."""
    return _collective(ctx, "all_gather", x.transpose(0, 1), group, tag).transpose(0, 1)


def _reduce_scatter_sequence(ctx, x, group, tag):
    """Sum the (b, s, h) partial results of every rank, keep this rank's (b, s/t, h) slice."""
    out = _collective(ctx, "reduce_scatter", x.transpose(0, 1), group, tag)
    return out.transpose(0, 1).contiguous()


class CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce backward (each rank's gradient is one part of the sum)."""

    @staticmethod
    def forward(fctx, x, ctx, group, tag):
        fctx.lab = ctx, group, tag
        return x.view_as(x)

    @staticmethod
    def backward(fctx, grad):
        ctx, group, tag = fctx.lab
        return _collective(ctx, "all_reduce", grad.clone(), group, f"{tag} bwd"), None, None, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs); identity backward."""

    @staticmethod
    def forward(fctx, x, ctx, group, tag):
        return _collective(ctx, "all_reduce", x.clone(), group, f"{tag} fwd")

    @staticmethod
    def backward(fctx, grad):
        return grad, None, None, None


class GatherFromSP(torch.autograd.Function):
    """Sequence parallel f: all-gather the sequence shards forward; reduce-scatter backward."""

    @staticmethod
    def forward(fctx, x, ctx, group, tag):
        fctx.lab = ctx, group, tag
        return _gather_sequence(ctx, x, group, f"{tag} fwd")

    @staticmethod
    def backward(fctx, grad):
        ctx, group, tag = fctx.lab
        return _reduce_scatter_sequence(ctx, grad, group, f"{tag} bwd"), None, None, None


class ScatterToSP(torch.autograd.Function):
    """Sequence parallel g: reduce-scatter the partial sums forward; all-gather backward."""

    @staticmethod
    def forward(fctx, x, ctx, group, tag):
        fctx.lab = ctx, group, tag
        return _reduce_scatter_sequence(ctx, x, group, f"{tag} fwd")

    @staticmethod
    def backward(fctx, grad):
        ctx, group, tag = fctx.lab
        return _gather_sequence(ctx, grad, group, f"{tag} bwd").contiguous(), None, None, None


def copy_to_tp(ctx, x, group, tag=""):
    return CopyToTP.apply(x, ctx, group, tag)


def reduce_from_tp(ctx, x, group, tag=""):
    return ReduceFromTP.apply(x, ctx, group, tag)


def gather_from_sp(ctx, x, group, tag=""):
    return GatherFromSP.apply(x, ctx, group, tag)


def scatter_to_sp(ctx, x, group, tag=""):
    return ScatterToSP.apply(x, ctx, group, tag)


class _GatherLinear(torch.autograd.Function):
    """gather_from_sp + linear that keeps only the sequence shard of its input for backward and
    all-gathers it again there (Korthikanti et al. sec. 4.2.2): 1/t the activation memory for
    one more all-gather, issued async so it overlaps the input-gradient matmul."""

    @staticmethod
    def forward(fctx, x, weight, bias, ctx, group, tag):
        fctx.lab = ctx, group, tag
        fctx.save_for_backward(x, weight)
        fctx.has_bias = bias is not None
        return F.linear(_gather_sequence(ctx, x, group, f"{tag} fwd"), weight, bias)

    @staticmethod
    def backward(fctx, grad):
        ctx, group, tag = fctx.lab
        x, weight = fctx.saved_tensors
        previous, ctx.comm.tag = ctx.comm.tag, f"{tag} bwd (regather)"
        pending = ctx.comm.all_gather(x.transpose(0, 1), group=group, async_op=True)
        ctx.comm.tag = previous
        grad_input = _reduce_scatter_sequence(ctx, grad @ weight, group, f"{tag} bwd")
        full = pending.wait().transpose(0, 1)
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
        grad_bias = grad.sum(dim=(0, 1)) if fctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None


# --------------------------------------------------------------------------- the layers

def _shard(tensor, group, dim, parts=1):
    """This rank's slice of `tensor` along `dim`; with parts=3 (fused q|k|v) the slice of each
    part, concatenated, so the local tensor keeps the q|k|v layout."""
    pieces = tensor.detach().chunk(parts, dim=dim)
    mine = [p.chunk(group.size, dim=dim)[group.rank] for p in pieces]
    param = nn.Parameter(torch.cat(mine, dim=dim).clone())
    param.tp_split = (dim, parts)  # how gather_params puts the full tensor back together
    return param


def _replicated(tensor):
    param = nn.Parameter(tensor.detach().clone())
    param.tp_split = None
    return param


class ColumnParallelLinear(nn.Module):
    """Y = X A^T with A split by output features: rank i computes its features Y_i = X A_i^T.

    The input is the same on every rank, so its gradient is a sum over ranks: f (all-reduce in
    backward) in front. With sequence parallelism the input arrives as a sequence shard and is
    all-gathered first. The output stays split by features: no communication after.
    """

    def __init__(self, ctx, group, linear, *, parts=1, sequence_parallel=False, regather=True,
                 tag=""):
        super().__init__()
        self.ctx, self.group, self.tag = ctx, group, tag
        self.sequence_parallel, self.regather = sequence_parallel, regather
        self.weight = _shard(linear.weight, group, dim=0, parts=parts)
        self.bias = _shard(linear.bias, group, 0, parts) if linear.bias is not None else None

    def forward(self, x):
        ctx, group, tag = self.ctx, self.group, self.tag
        if not self.sequence_parallel:
            return F.linear(copy_to_tp(ctx, x, group, tag), self.weight, self.bias)
        if self.regather:
            return _GatherLinear.apply(x, self.weight, self.bias, ctx, group, tag)
        return F.linear(gather_from_sp(ctx, x, group, tag), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A^T with A split by input features: X arrives split the same way (from a
    column-parallel layer), rank i computes the partial sum X_i A_i^T; g sums them (all-reduce,
    or reduce-scatter along the sequence with SP), then the bias is added once."""

    def __init__(self, ctx, group, linear, *, sequence_parallel=False, tag=""):
        super().__init__()
        self.ctx, self.group, self.tag = ctx, group, tag
        self.sequence_parallel = sequence_parallel
        self.weight = _shard(linear.weight, group, dim=1)
        self.bias = _replicated(linear.bias)

    def forward(self, x):
        partial = F.linear(x, self.weight)
        combine = scatter_to_sp if self.sequence_parallel else reduce_from_tp
        return combine(self.ctx, partial, self.group, self.tag) + self.bias


class ParallelMLP(nn.Module):
    """fc1 column-parallel (GELU runs on each rank's ffn/t features), fc2 row-parallel."""

    def __init__(self, ctx, group, mlp, *, sequence_parallel=False, regather=True, tag="mlp"):
        super().__init__()
        self.fc1 = ColumnParallelLinear(ctx, group, mlp.fc1, sequence_parallel=sequence_parallel,
                                        regather=regather, tag=tag)
        self.fc2 = RowParallelLinear(ctx, group, mlp.fc2, sequence_parallel=sequence_parallel,
                                     tag=tag)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelAttention(nn.Module):
    """Heads split across ranks: q, k and v column-parallel (each rank gets whole heads), the
    attention itself local, the output projection row-parallel."""

    def __init__(self, ctx, group, attn, heads, *, sequence_parallel=False, regather=True,
                 tag="attention"):
        super().__init__()
        self.local_heads = heads // group.size
        self.local_width = attn.proj.in_features // group.size
        # the reference's qkv is one Linear(h, 3h) with q|k|v stacked: shard each part by heads
        self.qkv = ColumnParallelLinear(ctx, group, attn.qkv, parts=3, regather=regather,
                                        sequence_parallel=sequence_parallel, tag=tag)
        self.proj = RowParallelLinear(ctx, group, attn.proj, sequence_parallel=sequence_parallel,
                                      tag=tag)

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.local_width, dim=-1)
        return self.proj(models.causal_attention(q, k, v, self.local_heads))

    def forward_cached(self, x, cache):
        """Inference: attend over the cached keys/values of this rank's heads plus the new ones."""
        b, s_new, _ = x.shape
        d = self.local_width // self.local_heads
        q, k, v = (t.view(b, s_new, self.local_heads, d).transpose(1, 2)
                   for t in self.qkv(x).split(self.local_width, dim=-1))
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        s_all = k.shape[2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        mask = torch.ones(s_new, s_all, dtype=torch.bool).triu(s_all - s_new + 1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, s_new, self.local_width)
        return self.proj(out)


class ParallelBlock(nn.Module):
    """A pre-LN block; LayerNorms are replicated (with SP they run on the sequence shard)."""

    def __init__(self, ctx, group, block, heads, *, sequence_parallel=False, regather=True,
                 tag="block"):
        super().__init__()
        options = dict(sequence_parallel=sequence_parallel, regather=regather)
        self.ln1, self.ln2 = _replicated_layernorm(block.ln1), _replicated_layernorm(block.ln2)
        self.attn = ParallelAttention(ctx, group, block.attn, heads, tag=f"{tag} attention",
                                      **options)
        self.mlp = ParallelMLP(ctx, group, block.mlp, tag=f"{tag} mlp", **options)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _replicated_layernorm(ln):
    ln = copy.deepcopy(ln)
    for p in ln.parameters():
        p.tp_split = None
    return ln


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding split by vocabulary: a rank looks up the tokens in its range,
    writes zeros for the others, and g sums the ranks' rows (SP: reduce-scatter)."""

    def __init__(self, ctx, group, embedding, *, sequence_parallel=False, tag="embedding"):
        super().__init__()
        self.ctx, self.group, self.tag = ctx, group, tag
        self.sequence_parallel = sequence_parallel
        self.weight = _shard(embedding.weight, group, dim=0)
        self.vocab_start = group.rank * self.weight.shape[0]

    def forward(self, idx):
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        combine = scatter_to_sp if self.sequence_parallel else reduce_from_tp
        return combine(self.ctx, rows, self.group, self.tag)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, without gathering them: the max, the
    target's logit and the sum of exponentials are all-reduced (b*s numbers each)."""

    @staticmethod
    def forward(fctx, logits, targets, ctx, group, vocab_start, tag):
        local_max = logits.max(dim=-1).values
        top = _collective(ctx, "all_reduce", local_max, group, f"{tag} max", op="max")
        shifted = logits - top.unsqueeze(-1)
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < logits.shape[-1])
        local_target = local_target.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
        target_logit = _collective(ctx, "all_reduce", target_logit, group, f"{tag} target")
        exp = shifted.exp()
        sum_exp = _collective(ctx, "all_reduce", exp.sum(dim=-1), group, f"{tag} sum exp")
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        fctx.save_for_backward(softmax, local_target, mine)
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(fctx, grad):
        softmax, local_target, mine = fctx.saved_tensors
        rows = torch.arange(softmax.shape[0])
        grad_logits = softmax.clone()
        grad_logits[rows, local_target] -= mine.to(softmax.dtype)
        return grad_logits * (grad / softmax.shape[0]), None, None, None, None, None


def vocab_parallel_cross_entropy(ctx, logits, targets, group, vocab_start, tag="loss"):
    """Mean cross-entropy of (N, V/t) local logits against (N,) global target ids."""
    return _VocabParallelCrossEntropy.apply(logits, targets, ctx, group, vocab_start, tag)


class TensorParallelGPT(nn.Module):
    """labkit's TinyGPT with every matrix sharded over `group`, built from the reference's
    weights, with the reference's parameter names (so shards can be gathered and compared)."""

    def __init__(self, ctx, group, reference, *, sequence_parallel=False, regather=True):
        super().__init__()
        self.ctx, self.group, self.cfg = ctx, group, reference.cfg
        self.sequence_parallel = sequence_parallel
        options = dict(sequence_parallel=sequence_parallel)
        self.tok = VocabParallelEmbedding(ctx, group, reference.tok, **options)
        self.pos = nn.Embedding.from_pretrained(reference.pos.weight.detach().clone(),
                                                freeze=False)
        self.pos.weight.tp_split = None
        self.blocks = nn.ModuleList(
            ParallelBlock(ctx, group, block, self.cfg.heads, regather=regather,
                          tag=f"block {i}", **options)
            for i, block in enumerate(reference.blocks))
        self.ln_f = _replicated_layernorm(reference.ln_f)
        self.head = ColumnParallelLinear(ctx, group, reference.head, regather=regather,
                                         tag="head", **options)

    def forward(self, idx, targets=None):
        s = idx.shape[1]
        x = self.tok(idx)
        if self.sequence_parallel:  # this rank holds positions [r s/t, (r+1) s/t)
            width = s // self.group.size
            positions = torch.arange(self.group.rank * width, (self.group.rank + 1) * width)
        else:
            positions = torch.arange(s)
        x = x + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (b, s, V/t): this rank's slice of the vocabulary
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(self.ctx, logits.reshape(-1, logits.shape[-1]),
                                            targets.reshape(-1), self.group,
                                            self.tok.vocab_start)

    @torch.no_grad()
    def forward_cached(self, idx, caches, start):
        """Inference without SP: logits (b, s_new, V/t) for tokens at positions start..;
        caches (one [k, v] list per block) grow by s_new."""
        x = self.tok(idx) + self.pos(torch.arange(start, start + idx.shape[1]))
        for block, cache in zip(self.blocks, caches):
            x = x + block.attn.forward_cached(block.ln1(x), cache)
            x = x + block.mlp(block.ln2(x))
        return self.head(self.ln_f(x))


def sync_sequence_parallel_grads(ctx, model):
    """With SP, a replicated parameter (LayerNorm, row-parallel bias, positions) saw only this
    rank's sequence shard: sum its gradient over the TP group (one flat all-reduce)."""
    params = [p for p in model.parameters() if p.tp_split is None and p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    flat = _collective(ctx, "all_reduce", flat, model.group, "sequence-parallel grads")
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


# ------------------------------------------------------------------ gathering shards back

def _gather_full(ctx, group, tensor, split):
    if split is None:
        return tensor.detach().clone()
    dim, parts = split
    pieces = []
    for part in tensor.detach().chunk(parts, dim=dim):
        gathered = ctx.comm.all_gather(part.movedim(dim, 0), group=group)
        pieces.append(gathered.movedim(0, dim))
    return torch.cat(pieces, dim=dim)


def gather_params(ctx, model, group=None):
    """{name: full tensor} with the reference's names (every rank calls it: all-gathers).
    `model` is any module built here (a TensorParallelGPT, ParallelBlock, ParallelMLP...)."""
    group = group or getattr(model, "group", ctx.world)
    return {name: _gather_full(ctx, group, p, p.tp_split)
            for name, p in model.named_parameters()}


def gather_grads(ctx, model, group=None):
    group = group or getattr(model, "group", ctx.world)
    return {name: _gather_full(ctx, group, p.grad, p.tp_split)
            for name, p in model.named_parameters()}


def gather_logits(ctx, model, logits):
    """(b, s, V/t) on every rank -> the full (b, s, V)."""
    return _gather_full(ctx, model.group, logits, (logits.dim() - 1, 1))


@contextmanager
def off_the_record(ctx):
    """Checks (gathering shards to compare them) are no part of the technique: keep their
    collectives out of the comm log and off the clock."""
    calls, enabled = len(ctx.comm.records), ctx.clock.enabled
    ctx.clock.enabled = False
    try:
        yield
    finally:
        del ctx.comm.records[calls:]
        ctx.clock.enabled = enabled


# ------------------------------------------------------------------------------- inference

def _greedy_pick(ctx, model, logits):
    """Global argmax over vocabulary shards: each rank's best (value, id), gathered."""
    value, index = logits.max(dim=-1)
    values = ctx.comm.all_gather(value, group=model.group).view(model.group.size, -1)
    ids = ctx.comm.all_gather(index + model.tok.vocab_start, group=model.group)
    best = values.argmax(dim=0)  # the first maximum: the lowest id wins ties, as torch.argmax
    return ids.view(model.group.size, -1).gather(0, best.unsqueeze(0)).squeeze(0)


def generate(ctx, model, prompt, new_tokens):
    """Greedy decoding with a KV cache of this rank's heads; returns (tokens, cache bytes)."""
    if model.sequence_parallel:
        raise ValueError("generate runs without sequence parallelism: build the model with "
                         "sequence_parallel=False (one new token has no sequence to split)")
    if prompt.shape[1] + new_tokens > model.cfg.seq:
        raise ValueError(f"prompt + new tokens must fit the {model.cfg.seq} positions")
    caches = [[] for _ in model.blocks]
    tokens, start, step_input = prompt, 0, prompt
    for _ in range(new_tokens):
        logits = model.forward_cached(step_input, caches, start)
        start += step_input.shape[1]
        step_input = _greedy_pick(ctx, model, logits[:, -1]).unsqueeze(1)
        tokens = torch.cat([tokens, step_input], dim=1)
    cache_bytes = sum(t.nbytes for cache in caches for t in cache)
    return tokens, cache_bytes


@torch.no_grad()
def reference_generate(model, prompt, new_tokens):
    """The single-device TinyGPT, greedy, recomputing the whole prefix each token (no cache)."""
    tokens = prompt
    for _ in range(new_tokens):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


# -------------------------------------------------------------------------- training run

def gpt_config(cfg):
    """The GPTConfig of a RunConfig (or a GPTConfig as is)."""
    if isinstance(cfg, models.GPTConfig):
        return cfg
    if cfg.model != "gpt":
        raise ValueError("tensor parallelism here splits the tiny GPT's matrices: use "
                         "--model gpt (the MLP model has no heads to split)")
    return models.GPTConfig(**cfg.model_kwargs)


def check_tp_degree(cfg, tp, sequence_parallel=False):
    """Raise a ValueError naming what `tp` fails to divide (before any rank starts)."""
    c = gpt_config(cfg)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"the TP degree must be a positive integer, got {tp!r}")
    sizes = dict(heads=(c.heads, "each rank computes whole attention heads"),
                 hidden=(c.hidden, "the attention output projection is split by it"),
                 ffn=(c.ffn, "the MLP's inner features are split across ranks"),
                 vocab=(c.vocab, "the embedding and the logits are split by vocabulary"))
    if sequence_parallel:
        sizes["seq"] = (c.seq, "sequence parallelism splits the sequence across ranks")
    for name, (size, why) in sizes.items():
        if size % tp:
            fits = [d for d in range(1, size + 1) if all(v % d == 0 for v, _ in sizes.values())]
            raise ValueError(f"TP degree {tp} does not divide {name}={size} ({why}); "
                             f"TP degrees that fit this model: {fits[:8]}")


def train(ctx, cfg, sequence_parallel=False, regather=True, details=False):
    """Train the TP tiny GPT on the TP group ctx.world; every rank sees the whole batch."""
    from .runs.report import rank_result
    check_tp_degree(cfg, ctx.world_size, sequence_parallel)
    model = TensorParallelGPT(ctx, ctx.world, build_model(cfg),
                              sequence_parallel=sequence_parallel, regather=regather)
    optimizer = build_optimizer(model.parameters(), cfg)
    ctx.memory.watch(model=model, optimizer=optimizer)
    losses, extra = [], {}
    for step in range(cfg.steps):
        x, y = global_batch(model, cfg, step)
        optimizer.zero_grad(set_to_none=True)
        with ctx.memory.track_activations(), ctx.clock.compute("forward+backward"):
            loss = model(x, y)
            loss.backward()
        if sequence_parallel:
            sync_sequence_parallel_grads(ctx, model)
        if details and step == cfg.steps - 1:
            with off_the_record(ctx), torch.no_grad():
                extra = dict(grads=gather_grads(ctx, model),
                             logits=gather_logits(ctx, model, model(x)))
        with ctx.clock.compute("optimizer step"):
            optimizer.step()
        ctx.memory.sample(f"after step {step}")
        ctx.clock.mark_step()
        ctx.progress(step + 1, cfg.steps)
        losses.append(loss.item())
    comm_log = ctx.comm.dataframe().to_dict("records")
    with off_the_record(ctx):
        params = gather_params(ctx, model)
    if ctx.rank != 0:
        params, extra = None, {}
    return rank_result(ctx, losses, params=params, comm_log=comm_log, **extra)


def predict_memory(cfg, tp, sequence_parallel=False, regather=True):
    """theory/'s bytes per rank: fp32 model states of the local parameters, TP activations."""
    c = gpt_config(cfg)
    n = theory_tp.tiny_gpt_params_per_rank(layers=c.layers, hidden=c.hidden, ffn=c.ffn,
                                           vocab=c.vocab, seq=c.seq, tp=tp)
    states = theory_memory.model_state_bytes(n, mixed_precision=False, optimizer=cfg.optimizer)
    out = dict(params=states["params"], grads=states["grads"], optimizer=states["optimizer"],
               activations=predict_activations(cfg, tp, sequence_parallel, regather))
    out["peak"] = sum(out.values())
    return out


def predict_activations(cfg, tp, sequence_parallel=False, regather=True):
    c = gpt_config(cfg)
    return theory_tp.tiny_gpt_activation_bytes(
        layers=c.layers, seq=c.seq, batch=cfg.global_batch, hidden=c.hidden, heads=c.heads,
        vocab=c.vocab, ffn=c.ffn, tp=tp, sequence_parallel=sequence_parallel, regather=regather)


def predict_comm(cfg, tp, sequence_parallel=False, regather=True):
    """{op: {calls, bytes, wire_bytes_per_rank}} for the whole run (theory/, fp32)."""
    c = gpt_config(cfg)
    step = theory_tp.tiny_gpt_comm(layers=c.layers, seq=c.seq, batch=cfg.global_batch,
                                   hidden=c.hidden, vocab=c.vocab, tp=tp,
                                   sequence_parallel=sequence_parallel, regather=regather)
    return {op: {k: v * cfg.steps for k, v in row.items()} for op, row in step.items()}


def add_arguments(parser):
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="shard LayerNorm regions along the sequence (Korthikanti 2022)")


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", sequence_parallel=False,
           regather=True, details=False, **_):
    """Run TP (world_size = TP degree) on the tiny GPT and return the run report."""
    from .runtime.launch import launch
    from .runs.report import build_report
    cfg = cfg or RunConfig()
    check_tp_degree(cfg, world_size, sequence_parallel)
    results = launch(train, world_size, cfg, sequence_parallel, regather, details,
                     cluster=cluster)
    comm = predict_comm(cfg, world_size, sequence_parallel, regather)
    first = results[0]
    return build_report(
        "tp", cfg, results,
        config=dict(tp=world_size, sequence_parallel=sequence_parallel, regather=regather),
        predicted_memory=predict_memory(cfg, world_size, sequence_parallel, regather),
        predicted_comm_bytes_per_rank=sum(r["wire_bytes_per_rank"] for r in comm.values()),
        predicted_comm=comm, comm_log=first["comm_log"],
        logits=first.get("logits"), grads=first.get("grads"))


# --------------------------------------------------------------------------------- exercise

def row_parallel_forward(ctx, x_shard, weight_shard, bias, group):
    """One answer to the exercise: partial sums, one all-reduce, then the bias, once."""
    return reduce_from_tp(ctx, F.linear(x_shard, weight_shard), group, "exercise") + bias


def _exercise_rank(ctx, fn):
    torch.manual_seed(0)
    full = nn.Linear(8, 6)
    x = torch.randn(4, 8, requires_grad=True)
    t, r = ctx.world_size, ctx.rank
    width = 8 // t
    x_shard = x.detach()[:, r * width:(r + 1) * width].clone().requires_grad_()
    w_shard = full.weight.detach()[:, r * width:(r + 1) * width].clone().requires_grad_()
    bias = full.bias.detach().clone().requires_grad_()
    expected = full(x)
    out = {"rank": r}
    warnings.simplefilter("ignore")  # an all-reduce outside autograd warns in backward
    try:
        y = fn(ctx, x_shard, w_shard, bias, ctx.world)
    except Exception as error:  # noqa: BLE001 - the learner's code: report, never crash
        out["error"] = f"{type(error).__name__}: {error}"
        return out
    out["calls"] = [rec.op for rec in ctx.comm.records]
    if not isinstance(y, torch.Tensor) or y.shape != expected.shape:
        out["shape"] = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        return out
    out["partial"] = F.linear(x_shard, w_shard).detach()
    out["y"], out["expected"], out["bias"] = y.detach(), expected.detach(), bias.detach()
    if y.requires_grad:
        y.sum().backward()
        expected.sum().backward()
        out["grad_ok"] = torch.allclose(w_shard.grad, full.weight.grad[:, r * width:
                                        (r + 1) * width], atol=1e-5)
    return out


def check_row_parallel(fn, world_size=2):
    """Run the learner's row-parallel forward on 2 ranks; return feedback in plain words."""
    from .runtime.launch import launch, LaunchError
    try:
        results = launch(_exercise_rank, world_size, fn, timeout_s=30)
    except LaunchError as error:
        return ("Your function did not finish on every rank: " + str(error).splitlines()[0]
                + ". Every rank must call the same collectives in the same order.")
    r0 = results[0]
    if "error" in r0:
        return f"Your function raised {r0['error']}. x_shard is (4, {8 // world_size}), " \
               f"weight_shard (6, {8 // world_size}): F.linear(x_shard, weight_shard) fits."
    if "shape" in r0:
        return (f"The output has shape {r0['shape']}, the full layer's is (4, 6). A row-parallel "
                "linear gives every rank the whole output: sum the partial results, do not "
                "concatenate them (that would be all_gather, for column-parallel outputs).")
    y, expected, bias, partial = r0["y"], r0["expected"], r0["bias"], r0["partial"]
    if torch.allclose(y, expected, atol=1e-5):
        if r0.get("grad_ok") is False:
            return ("The output is right but the weight gradient is not: keep the all-reduce "
                    "inside the autograd graph (labkit's reduce_from_tp, backward = identity).")
        return ("Correct: each rank multiplies its slice of the input features by its slice "
                "of the weight, one all-reduce sums the partial results, and the bias is "
                f"added once, after it. Communication: {', '.join(r0['calls'])}.")
    if torch.allclose(y, partial + bias, atol=1e-5) or torch.allclose(y, partial, atol=1e-5):
        return ("Each rank returns only its own partial sum X_i A_i^T: the results of the "
                "ranks are never added. Sum them with one all-reduce over the group "
                "(e.g. labkit.tensor_parallel.reduce_from_tp) before adding the bias.")
    if torch.allclose(y, expected + (world_size - 1) * bias, atol=1e-5):
        return (f"The bias is counted {world_size} times: every rank added it before the "
                "all-reduce summed the ranks. Add the bias after the all-reduce, once.")
    return ("The output differs from the full layer's (max difference "
            f"{(y - expected).abs().max():.3g}). Compute F.linear(x_shard, weight_shard) "
            "without bias, all-reduce (sum) it over the group, then add the bias.")
