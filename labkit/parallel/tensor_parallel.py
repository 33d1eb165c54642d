"""Tensor parallelism: split the weight matrices of any nn.Module across a process group.

The layers and collectives under `parallelize_module` (parallel_styles.py: torch's styles,
ColwiseParallel, RowwiseParallel, ...). labkit's earlier, deprecated spelling
`parallelize(module, plan, group=None, sequence_parallel=False)` with string styles replaces
each layer the plan names with a parallel layer that holds this rank's shard of the layer's
own weights, so the result computes what the unsplit module did.
Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053):
- "colwise" (nn.Linear): split the output features; rank i computes Y_i = X A_i^T from the
  whole input. Its input's gradient is a sum over ranks: f (identity forward, all-reduce
  backward) in front. A fused q|k|v projection (`qkv`, GPT-2's `c_attn`, ...:
  tensor_parallel_plan.fused_parts) is split part by part, so each rank gets q, k and v of
  whole heads. GPT-2's Conv1D (weight stored (in, out)) is split along its own axes.
- "rowwise" (nn.Linear): split the input features; the input arrives split (from a colwise
  layer), rank i computes the partial sum X_i A_i^T and g (all-reduce forward, identity
  backward) adds them; the bias is added once, after g.
- "vocab": nn.Embedding split by rows (token ids): a rank looks up the ids in its range, zeros
  elsewhere, g sums; nn.Linear (the output layer) split by vocabulary, logits all-gathered
  (`gather_output=False` keeps them split for `vocab_parallel_cross_entropy`).
Memory per rank: weights, grads and optimizer state of the split layers / t. Communication per
transformer block (attention and MLP, each colwise -> rowwise) and micro-batch: 2 all-reduces of
b*s*h forward (g) and 2 backward (f), on the critical path.

Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198): the regions between the
split layers (LayerNorm, dropout, residual adds) run on s/t of the sequence (dim -2): a colwise
layer all-gathers its input's sequence shards, a rowwise layer or a vocab embedding
reduce-scatters its sums along the sequence. Same ring bytes (all-reduce = reduce-scatter +
all-gather); activations per layer sbh(10 + 24/t + 5as/(ht)) -> sbh/t (34 + 5as/h) bytes
(16-bit). A replicated parameter then sees only this rank's tokens: its gradient is summed over
the group by a hook (so the whole module must run on sequence shards: a position embedding
joins the plan as "vocab", which hands each rank the rows of its own positions).

Hugging Face models: `parallelize(model)` takes the plan of `model.config.model_type` from
tp_presets.py, else transformers' own (data: print it, change it, pass your own), and first
checks it on a miniature of the model against one device (self_check.py; `verify=False`
skips it). Beyond Megatron's styles: "colwise_gather", "rowwise_split" and
"replicated_grad_sum" (tensor_parallel_plan.py), and an nn.Embedding subclass with its own
forward (Gemma's scaled rows) split by rows with that forward kept. Sequence parallelism is
refused on them: they build positions, the causal mask and the attention's reshape from the
length of the sequence they are handed, so shards would break inside the model. How a
parameter is cut and gathered back: tp_shards.py.
"""
import warnings
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..runtime.comm import GroupLike
from ..runtime.context import context
from .async_tp import all_gather_linear, linear_reduce_scatter
from .self_check import check_against_one_device, is_hugging_face
from .tensor_parallel_plan import (features, fused_parts, is_conv1d, localize_attention,
                                   plan_for, refuse_sequence_parallel, resolve_plan)
from .tp_presets import tp_plan_for
from .mappings import (SEQUENCE_DIM, all_gather_dim, all_reduce_copy, copy_to, gather_along,
                       gather_keep_slice, reduce_from, reduce_scatter_dim, scatter_along)
from .tp_shards import gather_grads, gather_params, shard  # noqa: F401 (API)

# The conjugate pairs (parallel/mappings.py), by their Megatron names: f and g of a split layer,
# and their sequence-parallel forms (gather / reduce-scatter along the sequence).
copy_to_tp, reduce_from_tp = copy_to, reduce_from
gather_from_sp, scatter_to_sp = gather_along, scatter_along


def gather_from_tp(x, group=None, tag=""):
    """All-gather the feature shards (last dim) forward; backward keeps this rank's slice."""
    return gather_keep_slice(x, group, f"{tag} (gather output)", dim=-1)


class _GatherLinear(torch.autograd.Function):
    """gather_from_sp + linear that keeps only the sequence shard of its input for backward and
    all-gathers it again there (Korthikanti et al. sec. 4.2.2): 1/t the activation memory for
    one more all-gather, issued async so it overlaps the input-gradient matmul."""

    @staticmethod
    def forward(fctx, x, weight, bias, group, tag):
        fctx.group, fctx.tag, fctx.has_bias = group, tag, bias is not None
        fctx.save_for_backward(x, weight)
        return F.linear(all_gather_dim(x, SEQUENCE_DIM, group, f"{tag} fwd"), weight, bias)

    @staticmethod
    def backward(fctx, grad):
        group, tag = fctx.group, fctx.tag
        x, weight = fctx.saved_tensors
        pending = context().comm.all_gather(x.movedim(SEQUENCE_DIM, 0), group=group,
                                            async_op=True, tag=f"{tag} bwd (regather)")
        grad_input = reduce_scatter_dim(grad @ weight, SEQUENCE_DIM, group, f"{tag} bwd") \
            if fctx.needs_input_grad[0] else None   # data in: no gradient to reduce
        full = pending.wait().movedim(0, SEQUENCE_DIM)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = flat_grad.t() @ full.reshape(-1, full.shape[-1])
        grad_bias = flat_grad.sum(dim=0) if fctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None


# --------------------------------------------------------------------------- the layers

class ColumnParallelLinear(nn.Module):
    """nn.Linear split by output features over `group`: f in front, output split (or gathered
    with `gather_output`). With sequence parallelism the input arrives as a sequence shard and
    is all-gathered first (`regather`: only the shard is kept for backward; `async_tp`: as a
    ring under the chunk matmuls, async_tp.py)."""

    def __init__(self, linear, group=None, *, parts=1, sequence_parallel=False,
                 gather_output=False, regather=True, async_tp=False, tag="", shared=None):
        super().__init__()
        self.group = context().group(group)
        self.in_features, self.out_features = features(linear)
        self.parts, self.tag, self.transposed = parts, tag, is_conv1d(linear)
        self.sequence_parallel, self.gather_output, self.regather = (
            sequence_parallel, gather_output, regather)
        self.async_tp = async_tp and sequence_parallel
        self.weight = shard(linear.weight, self.group, int(self.transposed), parts, shared)
        self.bias = shard(linear.bias, self.group, 0, parts, shared)

    def forward(self, x):
        group, tag = self.group, self.tag
        weight = self.weight.t() if self.transposed else self.weight   # Conv1D: (in, out)
        if not self.sequence_parallel:
            y = F.linear(copy_to_tp(x, group, tag), weight, self.bias)
        elif self.async_tp:
            y = all_gather_linear(x, weight, self.bias, group, tag, self.regather)
        elif self.regather:
            y = _GatherLinear.apply(x, weight, self.bias, group, tag)
        else:
            y = F.linear(gather_from_sp(x, group, tag), weight, self.bias)
        return gather_from_tp(y, group, tag) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank: {self.weight.shape[int(self.transposed)]}), "
                f"parts={self.parts}, "
                f"group={list(self.group.ranks)}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """nn.Linear split by input features over `group`: partial sums, g (all-reduce, or a
    reduce-scatter along the sequence with SP; `async_tp`: a ring under the chunk matmuls),
    then the replicated bias, once. `split_input`: the input arrives whole (HF's
    `rowwise_split_input`) and each rank takes its slice, behind f: the all-reduce of the
    zero-padded slices' gradients is the all-gather of the input's gradient."""

    def __init__(self, linear, group=None, *, sequence_parallel=False, async_tp=False, tag="",
                 shared=None, split_input=False):
        super().__init__()
        self.group = context().group(group)
        self.in_features, self.out_features = features(linear)
        self.sequence_parallel, self.tag, self.split_input = sequence_parallel, tag, split_input
        self.async_tp = async_tp and sequence_parallel
        self.transposed = is_conv1d(linear)
        self.weight = shard(linear.weight, self.group, 1 - self.transposed, 1, shared)
        self.bias = linear.bias   # replicated (the original object): added once, after g

    def forward(self, x):
        weight = self.weight.t() if self.transposed else self.weight   # Conv1D: (in, out)
        if self.split_input:
            x = copy_to_tp(x, self.group, f"{self.tag} (split input)")
            x = x.chunk(self.group.size, dim=-1)[self.group.rank]
        if self.async_tp:
            y = linear_reduce_scatter(x, weight, self.group, self.tag)
        else:
            combine = scatter_to_sp if self.sequence_parallel else reduce_from_tp
            y = combine(F.linear(x, weight), self.group, self.tag)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in_features={self.in_features} "
                f"(this rank: {self.weight.shape[1 - self.transposed]}), "
                f"out_features={self.out_features}, group={list(self.group.ranks)}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding split by rows: a rank looks up the ids in its range [start, start + V/t),
    writes zeros for the others, and g sums the ranks' rows (SP: reduce-scatter)."""

    def __init__(self, embedding, group=None, *, sequence_parallel=False, tag="", shared=None):
        super().__init__()
        self.group = context().group(group)
        self.sequence_parallel, self.tag = sequence_parallel, tag
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.weight = shard(embedding.weight, self.group, 0, 1, shared)
        rows = self.weight.shape[0]
        self.vocab_start = self.group.rank * rows
        pad = embedding.padding_idx
        self.padding_idx = pad - self.vocab_start if pad is not None and \
            0 <= pad - self.vocab_start < rows else None

    def forward(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        combine = scatter_to_sp if self.sequence_parallel else reduce_from_tp
        return combine(rows, self.group, self.tag)


def split_embedding_in_place(embedding, group=None, *, sequence_parallel=False, tag="",
                             shared=None):
    """`VocabParallelEmbedding` for an nn.Embedding subclass with its own forward (Gemma's
    multiplies the rows by sqrt(hidden)): the module stays, with this rank's rows as its weight;
    a forward pre-hook hands its own forward local ids (0 for ids outside the range) and a
    forward hook zeroes those rows and sums the ranks' (g). Right for any forward that maps each
    id to a vector of its own row. Its other parameters see only this rank's ids: their
    gradients are summed over the group. (torch's parallelize_module hooks forward the same way.)"""
    group = context().group(group)
    embedding.weight = shard(embedding.weight, group, 0, 1, shared)
    rows = embedding.weight.shape[0]
    start = group.rank * rows
    pad = embedding.padding_idx
    embedding.padding_idx = pad - start if pad is not None and 0 <= pad - start < rows else None
    embedding.num_embeddings = rows
    combine = scatter_to_sp if sequence_parallel else reduce_from_tp
    outside = {}   # the mask of the current call, from the pre-hook to the hook

    def local_ids(module, args):
        local = args[0] - start
        outside["mask"] = (local < 0) | (local >= rows)
        return (local.masked_fill(outside["mask"], 0),) + tuple(args[1:])

    def sum_over_ranks(module, args, rows_out):
        mine = rows_out.masked_fill(outside.pop("mask").unsqueeze(-1), 0.0)
        return combine(mine, group, tag)

    embedding.register_forward_pre_hook(local_ids)
    embedding.register_forward_hook(sum_over_ranks)
    sum_gradients(embedding, group, tag, skip=embedding.weight)
    return embedding


def sum_gradients(module, group, tag, skip=None):
    """The "replicated_grad_sum" style: `module` stays whole on every rank, and each of its
    parameters' gradients is summed over `group` (a hook; f's backward), for a parameter that
    sees only this rank's part (Qwen3's q/k norms act on this rank's heads). Returns module."""
    for name, param in module.named_parameters():
        if param is skip or not param.requires_grad or getattr(param, "_tp_sum", False):
            continue
        param.register_hook(partial(all_reduce_copy, group=group,
                                    tag=f"{tag}.{name} grad sum"))
        param._tp_sum = True
    return module


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, without gathering them: the max, the
    target's logit and the sum of exponentials are all-reduced (one number per token each)."""

    @staticmethod
    def forward(fctx, logits, targets, group, tag):
        vocab_start = group.rank * logits.shape[-1]
        comm = context().comm
        top = comm.all_reduce(logits.max(dim=-1).values, op="max", group=group,
                              tag=f"{tag} max")
        shifted = logits - top.unsqueeze(-1)
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < logits.shape[-1])
        local_target = local_target.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
        target_logit = comm.all_reduce(target_logit, group=group, tag=f"{tag} target")
        exp = shifted.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), group=group, tag=f"{tag} sum exp")
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        fctx.save_for_backward(softmax, local_target, mine)
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(fctx, grad):
        softmax, local_target, mine = fctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits[torch.arange(softmax.shape[0]), local_target] -= mine.to(softmax.dtype)
        return grad_logits * (grad / softmax.shape[0]), None, None, None


def vocab_parallel_cross_entropy(logits, targets, group=None, tag="loss"):
    """Mean cross-entropy of (N, V/t) local logits (rank i holds ids i*V/t...) against (N,)
    global target ids: equals F.cross_entropy of the gathered logits."""
    return _VocabParallelCrossEntropy.apply(logits, targets, context().group(group), tag)


@torch.no_grad()
def vocab_parallel_argmax(logits, group=None, tag="greedy"):
    """The global argmax id of (..., V/t) local logits split by vocabulary: each rank's best
    (value, id), all-gathered (2 numbers per row instead of V/t). Ties: the lowest id wins,
    as with torch.argmax on the gathered logits."""
    group, comm = context().group(group), context().comm
    value, index = logits.max(dim=-1)
    values = comm.all_gather(value, group=group, tag=tag).view(group.size, -1)
    ids = comm.all_gather(index + group.rank * logits.shape[-1], group=group, tag=tag)
    best = values.argmax(dim=0)   # the first maximum: the lowest rank, so the lowest id
    return ids.view(group.size, -1).gather(0, best.unsqueeze(0)).squeeze(0)


# ---------------------------------------------------------------------------- the plan

def _build(style, layer, name, group, shared, sequence_parallel, regather, gather_output,
           async_tp, root):
    options = dict(sequence_parallel=sequence_parallel, tag=name, shared=shared)
    if style == "replicated_grad_sum":
        return sum_gradients(layer, group, name)
    if isinstance(layer, nn.Embedding):
        if type(layer).forward is not nn.Embedding.forward:   # keep the subclass's forward
            return split_embedding_in_place(layer, group, **options)
        return VocabParallelEmbedding(layer, group, **options)
    if style in ("rowwise", "rowwise_split"):
        return RowParallelLinear(layer, group, async_tp=async_tp,
                                 split_input=style == "rowwise_split", **options)
    parts = fused_parts(name, layer, root) if style == "colwise" else 1
    gather = style == "colwise_gather" or (gather_output and style == "vocab")
    return ColumnParallelLinear(layer, group, parts=parts, regather=regather, async_tp=async_tp,
                                gather_output=gather, **options)


def parallelize(module: nn.Module, plan: Mapping[str, str] | None = None,
                group: GroupLike = None, sequence_parallel: bool = False,
                **options) -> nn.Module:
    """labkit's earlier spelling of `parallelize_module` (deprecated): string styles and one
    `sequence_parallel` flag; the arguments are those of `_parallelize_by_strings`."""
    warnings.warn("labkit.parallel.parallelize(module, plan, group) is deprecated: use "
                  "parallelize_module(module, device_mesh, parallelize_plan) with "
                  "ColwiseParallel / RowwiseParallel / SequenceParallel styles, torch's names",
                  DeprecationWarning, stacklevel=2)
    return _parallelize_by_strings(module, plan, group, sequence_parallel, **options)


def _parallelize_by_strings(module: nn.Module, plan: Mapping[str, str] | None = None,
                            group: GroupLike = None,
                            sequence_parallel: bool = False, *, regather: bool = True,
                            gather_output: bool = True, async_tp: bool = False,
                            verify: bool | None = None) -> nn.Module:
    """Split the layers `plan` names ({glob: "colwise" | "rowwise" | "vocab"}) over `group`
    (None: the world), in place; returns `module`. Every rank of the group calls it on the
    same (identically initialised) module and feeds the same input (with sequence_parallel:
    the same whole sequence to a vocab embedding, or its own sequence shard).
    regather (SP): a colwise layer keeps only its input's sequence shard for backward and
    all-gathers it again there (False: keeps the gathered input). gather_output=False: a
    "vocab" Linear (the output layer) leaves its logits split by vocabulary, for
    `vocab_parallel_cross_entropy`. async_tp (needs SP): the Linears' sequence all-gather and
    reduce-scatter run as rings of sends under the chunk matmuls (async_tp.py).
    plan=None: the preset for a Hugging Face model's `config.model_type`, else transformers'
    own plan (tp_presets.py); attention modules that store head counts get this rank's
    (`localize_attention`). verify (default: on for Hugging Face models): before splitting,
    the same plan on a miniature of the model must equal one device, logits and every gradient,
    a replicated parameter's on each rank (self_check.py, ~0.3 s); False skips it."""
    if async_tp and not sequence_parallel:
        raise ValueError("async_tp=True needs sequence_parallel=True: it decomposes the "
                         "sequence all-gather / reduce-scatter around the matmuls")
    if plan is None:
        plan = tp_plan_for(module)
    if sequence_parallel:
        refuse_sequence_parallel(module)
    group = context().group(group)
    targets = resolve_plan(module, plan, group.size)
    if verify or (verify is None and is_hugging_face(module)):
        _verify(module, plan, group, sequence_parallel, regather, async_tp)
    shared = {}
    for name, style in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        parent._modules[leaf] = _build(style, parent._modules[leaf], name, group, shared,
                                       sequence_parallel, regather, gather_output, async_tp,
                                       module)
    localize_attention(module, targets, group.size)
    for name, param in module.named_parameters():
        if getattr(param, "tp_split", None) is not None:
            continue
        param.tp_split, param.tp_group = None, group
        if sequence_parallel and param.requires_grad and not getattr(param, "_tp_sum", False):
            # it saw only this rank's tokens: the full gradient is the sum over the group
            param.register_hook(partial(all_reduce_copy, group=group,
                                        tag=f"sequence-parallel grad {name}"))
            param._tp_sum = True
    return module


def _verify(module, plan, group, sequence_parallel, regather, async_tp):
    """The self-check (self_check.py): the plan's entries that name a module of the miniature,
    applied to it with the logits gathered, against one device."""
    def apply(mini):   # a plan naming only layers the miniature lacks: nothing to check
        mini_plan = plan_for(mini, plan)
        return _parallelize_by_strings(mini, mini_plan, group, sequence_parallel,
                                       regather=regather, async_tp=async_tp,
                                       verify=False) if mini_plan else mini
    check_against_one_device(module, apply, group, what="parallelize_module(plan)",
                             forward=lambda model, ids: model(ids), gradients=gather_grads)
