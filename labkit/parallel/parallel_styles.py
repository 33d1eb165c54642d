"""torch's tensor-parallel API on labkit's split layers: `parallelize_module` and its styles.

`parallelize_module(module, device_mesh, parallelize_plan)` takes the plan a learner writes for
`torch.distributed.tensor.parallel` ({module name glob: ParallelStyle}) and maps each style onto
the mechanisms of tensor_parallel.py, where the collectives are in plain sight (Megatron's f and
g, the sequence all-gather and reduce-scatter). torch tracks each activation's layout in a
DTensor; labkit's activations are plain local tensors, so a style's layouts say which collective
goes where, once, when the plan is applied:

    ColwiseParallel()                              colwise: f in front, output split by features
    ColwiseParallel(input_layouts=Shard(1))        SP: all-gather the sequence first
    ColwiseParallel(output_layouts=Replicate())    output all-gathered (an lm_head: "vocab")
    RowwiseParallel()                              rowwise: partial sums, all-reduce (g)
    RowwiseParallel(output_layouts=Shard(1))       SP: reduce-scatter along the sequence
    RowwiseParallel(input_layouts=Replicate())     on nn.Linear: each rank slices a whole input;
                                                   on nn.Embedding: split by rows ("vocab")
    SequenceParallel()                             a norm on sequence shards: grads summed
    PrepareModuleInput(Shard(1) -> Replicate())    all-gather a module's input along the sequence

A gradient is reduced where a replicated activation meets a split layer (f), so labkit's
Shard -> Replicate keeps this rank's slice in backward where torch reduce-scatters once: the
same values, more bytes (docs/torch-differences.md). `loss_parallel()`: logits left split by
vocabulary (`ColwiseParallel(use_local_output=False)`) go to `F.cross_entropy` inside it, which
runs tensor_parallel.vocab_parallel_cross_entropy (three all-reduces of one number per token).
`Replicate` / `Shard` are labkit's placements; torch's (torch.distributed.tensor) work too.
"""
import contextlib
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..runtime.context import context
from .mappings import SEQUENCE_DIM, gather_keep_slice
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              split_embedding_in_place, sum_gradients,
                              vocab_parallel_cross_entropy)
from .tensor_parallel_plan import check_layer, fused_parts, is_conv1d


# --------------------------------------------------------------------------- placements

@dataclass(frozen=True)
class Replicate:
    """The whole tensor on every rank (torch.distributed.tensor.Replicate)."""

    def is_replicate(self):
        return True

    def is_shard(self, dim=None):
        return False


@dataclass(frozen=True)
class Shard:
    """This rank's slice along `dim` (torch.distributed.tensor.Shard)."""
    dim: int

    def is_replicate(self):
        return False

    def is_shard(self, dim=None):
        return dim is None or dim == self.dim


def _kind(layout, ndim=3):
    """'replicate', 'sequence' (Shard(1) or Shard(-2) of a (b, s, h) activation) or 'features'
    (Shard(-1) / Shard(2)) for a labkit or a torch placement; one line for any other."""
    if layout.is_replicate():
        return "replicate"
    dim = getattr(layout, "dim", None)
    if dim is not None and layout.is_shard():
        if dim % ndim == SEQUENCE_DIM % ndim:
            return "sequence"
        if dim % ndim == ndim - 1:
            return "features"
    raise ValueError(f"layout {layout}: labkit's tensor parallelism knows Replicate(), "
                     "Shard(1) (the sequence of a (batch, seq, hidden) activation) and "
                     "Shard(-1) (the features)")


# --------------------------------------------------------------------------- the styles

class ParallelStyle:
    """What `parallelize_module` does to one module of the plan."""

    def check(self, module, name, tp, root):
        """One-line ValueError for what cannot work, before any weight is touched."""

    def apply(self, module, name, group, shared):   # -> the module that replaces it
        raise NotImplementedError


class ColwiseParallel(ParallelStyle):
    """nn.Linear (or GPT-2's Conv1D) split by output features; input Replicate() (f in front)
    or Shard(1) (sequence shards, all-gathered); output Shard(-1) (split) or Replicate()
    (all-gathered). use_local_output=False with a split output: logits for loss_parallel()."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Shard(-1)
        self.use_local_output = use_local_output

    def check(self, module, name, tp, root):
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise ValueError(f"ColwiseParallel on {name} ({type(module).__name__}): labkit "
                             "splits nn.Linear by columns (an nn.Embedding: RowwiseParallel)")
        if _kind(self.input_layouts) == "features":
            raise ValueError(f"ColwiseParallel on {name}: input_layouts must be Replicate() "
                             "or Shard(1)")
        if _kind(self.output_layouts) == "sequence":
            raise ValueError(f"ColwiseParallel on {name}: output_layouts must be Shard(-1) "
                             "or Replicate()")
        gather = _kind(self.output_layouts) == "replicate"
        check_layer(name, module, "colwise_gather" if gather else "colwise", tp, root)

    def apply(self, module, name, group, shared):
        sequence = _kind(self.input_layouts) == "sequence"
        gather = _kind(self.output_layouts) == "replicate"
        layer = ColumnParallelLinear(module, group, parts=fused_parts(name, module),
                                     sequence_parallel=sequence, gather_output=gather,
                                     tag=name, shared=shared)
        if not gather and not self.use_local_output:   # logits split by vocabulary
            layer.register_forward_hook(lambda _, args, out: _vocab_sharded(out, layer.group))
        return layer


class RowwiseParallel(ParallelStyle):
    """nn.Linear split by input features: input Shard(-1) (from a colwise layer) or Replicate()
    (each rank takes its slice); output Replicate() (all-reduce) or Shard(1) (reduce-scatter
    along the sequence). nn.Embedding split by rows: input_layouts=Replicate() (the ids)."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True):
        self.input_layouts = input_layouts or Shard(-1)
        self.output_layouts = output_layouts or Replicate()
        self.use_local_output = use_local_output

    def check(self, module, name, tp, root):
        if _kind(self.output_layouts) == "features":
            raise ValueError(f"RowwiseParallel on {name}: output_layouts must be Replicate() "
                             "or Shard(1)")
        if isinstance(module, nn.Embedding):
            if _kind(self.input_layouts) != "replicate":
                raise ValueError(f"RowwiseParallel on the nn.Embedding {name} takes its ids "
                                 "whole: input_layouts=Replicate()")
            return check_layer(name, module, "vocab", tp, root)
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise ValueError(f"RowwiseParallel on {name} ({type(module).__name__}): labkit "
                             "splits nn.Linear and nn.Embedding")
        if _kind(self.input_layouts) == "sequence":
            raise ValueError(f"RowwiseParallel on {name}: input_layouts must be Shard(-1) or "
                             "Replicate()")
        split = _kind(self.input_layouts) == "replicate"
        check_layer(name, module, "rowwise_split" if split else "rowwise", tp, root)

    def apply(self, module, name, group, shared):
        options = dict(sequence_parallel=_kind(self.output_layouts) == "sequence", tag=name,
                       shared=shared)
        if isinstance(module, nn.Embedding):
            if type(module).forward is not nn.Embedding.forward:   # Gemma's scaled rows
                return split_embedding_in_place(module, group, **options)
            return VocabParallelEmbedding(module, group, **options)
        layer = RowParallelLinear(module, group, split_input=_kind(self.input_layouts) ==
                                  "replicate", **options)
        if options["sequence_parallel"] and layer.bias is not None:
            # the bias is added to this rank's tokens only: its gradient is summed (torch: a
            # Replicate DTensor's partial gradient, reduced)
            sum_gradients(layer, group, name, skip=layer.weight)
        return layer


class SequenceParallel(ParallelStyle):
    """A module kept whole that runs on this rank's sequence shard (LayerNorm, RMSNorm,
    dropout): its parameters' gradients are summed over the group."""

    def __init__(self, *, sequence_dim=1, use_local_output=False):
        self.sequence_dim, self.use_local_output = sequence_dim, use_local_output

    def apply(self, module, name, group, shared):
        if not any(p.requires_grad for p in module.parameters()):
            return module   # dropout, a norm without weights: nothing to sum
        return sum_gradients(module, group, name)


class PrepareModuleInput(ParallelStyle):
    """Re-lay a module's inputs before its forward: for each positional input (None: leave it)
    and keyword input, Shard(1) -> Replicate() all-gathers it along the sequence; equal
    layouts change nothing."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_output=False):
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        self.input_kwarg_layouts = input_kwarg_layouts or {}
        self.desired_input_kwarg_layouts = desired_input_kwarg_layouts or {}
        self.use_local_output = use_local_output
        if len(self.input_layouts) != len(self.desired_input_layouts):
            raise ValueError("PrepareModuleInput: input_layouts and desired_input_layouts "
                             "must have the same length")
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError("PrepareModuleInput: input_kwarg_layouts and "
                             "desired_input_kwarg_layouts must name the same inputs")
        pairs = list(zip(self.input_layouts, self.desired_input_layouts)) + [
            (v, self.desired_input_kwarg_layouts[k]) for k, v in self.input_kwarg_layouts.items()]
        for have, want in pairs:
            if have is not None and want is not None and have != want and not (
                    _kind(have) == "sequence" and _kind(want) == "replicate"):
                raise ValueError(f"PrepareModuleInput: {have} -> {want}: labkit re-lays an "
                                 "input from Shard(1) to Replicate() only")

    def apply(self, module, name, group, shared):
        def relay(value, have, want):
            if have is None or want is None or have == want or not torch.is_tensor(value):
                return value
            return gather_keep_slice(value, group, f"{name} (input)", dim=SEQUENCE_DIM)

        def prepare(_, args, kwargs):
            args = tuple(relay(a, *layouts) if i < len(self.input_layouts) else a
                         for i, (a, layouts) in enumerate(zip(args, self._pairs(len(args)))))
            kwargs = {k: relay(v, self.input_kwarg_layouts.get(k),
                               self.desired_input_kwarg_layouts.get(k))
                      for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(prepare, with_kwargs=True)
        return module

    def _pairs(self, n):
        pairs = list(zip(self.input_layouts, self.desired_input_layouts))
        return pairs + [(None, None)] * (n - len(pairs))


def _as_tuple(layouts):
    if layouts is None:
        return ()
    return tuple(layouts) if isinstance(layouts, (tuple, list)) else (layouts,)


# --------------------------------------------------------------------------- loss_parallel

_loss_parallel_on = [False]
_sharded_types = {}   # one subclass per group: an op's result keeps its type, and the group


class VocabShardedLogits(torch.Tensor):
    """Local logits split by vocabulary (the last dim) over `group`: F.cross_entropy on them
    (after any reshape) runs the vocabulary-parallel loss inside loss_parallel(), and is
    refused outside it (the local slice alone would give a wrong loss)."""
    group = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            return _parallel_cross_entropy(cls.group, *args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _vocab_sharded(logits, group):
    kind = _sharded_types.get(group)
    if kind is None:
        kind = _sharded_types[group] = type("VocabShardedLogits", (VocabShardedLogits,),
                                            {"group": group})
    return logits.as_subclass(kind)


def _parallel_cross_entropy(group, input, target, weight=None, size_average=None,
                            ignore_index=-100, reduce=None, reduction="mean",
                            label_smoothing=0.0):
    if not _loss_parallel_on[0]:
        raise ValueError("F.cross_entropy on logits split by vocabulary (ColwiseParallel("
                         "use_local_output=False)): call it inside loss_parallel()")
    if weight is not None or size_average is not None or reduce is not None \
            or label_smoothing or reduction not in ("mean", "sum"):
        raise ValueError("loss_parallel: labkit's cross-entropy takes reduction='mean' or "
                         "'sum' only (no weight, no label_smoothing)")
    with torch._C.DisableTorchFunctionSubclass():
        logits = input.as_subclass(torch.Tensor)
        if logits.dim() != 2:
            raise ValueError(f"loss_parallel: logits of shape {tuple(logits.shape)}; flatten "
                             "them to (tokens, vocab) first")
        if bool((target == ignore_index).any()):
            raise ValueError(f"loss_parallel: a target equals ignore_index={ignore_index}; "
                             "labkit's vocabulary-parallel loss counts every token")
        loss = vocab_parallel_cross_entropy(logits, target, group)
        return loss * target.numel() if reduction == "sum" else loss


@contextlib.contextmanager
def loss_parallel():
    """F.cross_entropy on vocabulary-split logits runs without gathering them (torch's
    torch.distributed.tensor.parallel.loss_parallel)."""
    before = _loss_parallel_on[0]
    _loss_parallel_on[0] = True
    try:
        yield
    finally:
        _loss_parallel_on[0] = before


# --------------------------------------------------------------------------- the plan

def _group_of(device_mesh):
    """A labkit Group from a 1-D device mesh (torch's DeviceMesh or a labkit mesh dimension),
    a labkit Group, a torch ProcessGroup or None (the world)."""
    ctx = context()
    if device_mesh is None or not hasattr(device_mesh, "get_group"):
        return ctx.group(device_mesh)
    if getattr(device_mesh, "ndim", 1) != 1:
        raise ValueError(f"parallelize_module needs a 1-D mesh, got {device_mesh.ndim} "
                         "dimensions: pass mesh['tp']")
    return ctx.group(device_mesh.get_group())


def _matches(pattern, name):   # torch's rule: fnmatch atom by atom
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(map(fnmatchcase, parts, atoms))


def parallelize_module(module: nn.Module, device_mesh=None, parallelize_plan=None,
                       *, src_data_rank=0, **string_plan_options) -> nn.Module:
    """Apply `parallelize_plan` (a ParallelStyle for `module` itself, or {glob: ParallelStyle})
    over the 1-D `device_mesh` in place; returns `module`. Every rank calls it on the same,
    identically initialised module. A plan of labkit's style strings ("colwise", ...) or None
    (a Hugging Face preset) goes to the earlier `tensor_parallel.parallelize`, with its options
    (sequence_parallel, async_tp, regather, gather_output, verify) as keywords."""
    if src_data_rank != 0:
        raise ValueError("parallelize_module(src_data_rank=...): labkit slices every rank's "
                         "own copy; build the module identically on every rank")
    group = _group_of(device_mesh)
    if parallelize_plan is None or (isinstance(parallelize_plan, dict) and any(
            isinstance(v, str) for v in parallelize_plan.values())):
        from .tensor_parallel import _parallelize_by_strings
        return _parallelize_by_strings(module, parallelize_plan, group, **string_plan_options)
    if string_plan_options:
        raise ValueError(f"parallelize_module({', '.join(string_plan_options)}=...) goes with a "
                         "plan of labkit's style strings; torch's styles carry their layouts")
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.check(module, type(module).__name__, group.size, module)
        return parallelize_plan.apply(module, type(module).__name__, group, {})
    if not isinstance(parallelize_plan, dict):
        raise ValueError("parallelize_plan must be a ParallelStyle or {module glob: style}")
    named = {name: m for name, m in module.named_modules() if name}
    targets = []
    for pattern, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise ValueError(f"parallelize_plan[{pattern!r}] = {style!r}: labkit's styles are "
                             "ColwiseParallel, RowwiseParallel, SequenceParallel, "
                             "PrepareModuleInput (from labkit.parallel)")
        hits = [name for name in named if _matches(pattern, name)]
        if not hits:
            raise ValueError(f"plan key {pattern!r} matches no module of "
                             f"{type(module).__name__}")
        targets += [(name, style) for name in hits]
    for name, style in targets:   # everything checked before any weight is touched
        style.check(named[name], name, group.size, module)
    shared = {}   # tied weights stay tied
    for name, style in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        parent._modules[leaf] = style.apply(parent._modules[leaf], name, group, shared)
    for param in module.parameters():   # gather_params: unsplit parameters are whole
        if not hasattr(param, "tp_split"):
            param.tp_split, param.tp_group = None, group
    return module
