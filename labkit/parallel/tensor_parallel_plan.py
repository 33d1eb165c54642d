"""Which layers a tensor-parallel plan names, and whether a TP degree can split them.

A plan is {module name glob: style}, as in PyTorch's `parallelize_module`: "colwise",
"rowwise" or "vocab" (labkit.parallel.tensor_parallel splits the layers). Globs match names
atom by atom ("blocks.*.mlp.fc1": `*` stands for one name). `resolve_plan` checks everything
before any weight is touched: the style fits the layer's type (nn.Linear, or GPT-2's Conv1D,
a Linear with its weight stored transposed), the degree divides the features it splits and
the heads (query and key/value heads, from the attention module or the model's config).

Fused projections (`fused_parts`): a colwise split of q|k|v concatenated along the outputs
must split each part, or rank 0 would get all of q and half of k. Known by name and shape:
q|k|v blocks in `qkv` (labkit), `c_attn` (GPT-2), `W_pack` (Baichuan), `qkv_proj` (Phi-3,
GQA sizes from the config); `query_key_value` (GPT-NeoX, Bloom) interleaves q, k, v per head,
so a contiguous split of whole heads is right; `gate_up_proj` is gate|up. Any other name that
looks fused is refused. After the split, an attention module that stores its head counts
(GPT-2's `num_heads`, `split_size`) or reads its config in forward (Phi-3) gets this rank's
(`localize_attention`: the module's attributes, a copy of its config).

Beyond Megatron's three styles, those transformers' own plans use (`base_model_tp_plan`):
"colwise_gather" (colwise, output all-gathered: every rank then runs what follows on the whole
features, OLMo2's q/k/v before its full-width q/k norms), "rowwise_split" (rowwise on a whole
input, each rank taking its slice) and "replicated_grad_sum" (a module kept whole whose
gradient is partial: Qwen3's per-head q/k norms see only this rank's heads, so the group sums
their gradients). Refused in one line, as they would train wrong: a Linear subclass whose
own forward is not nn.Linear's (a split would replace it; FalconLinear's is, checked on a
random input), ALiBi attention split by heads (the slopes are built for all heads outside the
attention), per-head module lists (StableLM's q/k norms: HF pairs them with the local heads by
position).
"""
import copy
import fnmatch
import re
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import numerics

STYLES = ("colwise", "rowwise", "vocab", "colwise_gather", "rowwise_split", "replicated_grad_sum")
HEAD_SPLITTING = ("colwise", "rowwise")   # each rank then computes its own heads
ALIBI_FAMILIES = ("bloom",)   # ALiBi always, no config flag (Falcon, MPT: config.alibi)
QKV_BLOCKS = ("qkv", "c_attn", "W_pack", "qkv_proj")   # q|k|v concatenated: split each part
PER_HEAD = ("query_key_value",)   # (heads, 3, head_dim): contiguous whole heads are right
PAIRS = ("gate_up_proj",)         # gate|up concatenated: split each half
LOOKS_FUSED = re.compile(r"qkv|kv_proj|gate_up|fused|packed|query_key_value|w_pack|c_attn",
                         re.IGNORECASE)
HEAD_COUNTS = ("heads", "num_heads", "n_head", "n_heads", "num_attention_heads",
               "num_key_value_heads", "num_kv_heads")
CONFIG_HEADS = ("num_attention_heads", "num_key_value_heads")   # a Hugging Face config's
# what attention modules store and reshape by (transformers 4.x: num_heads, hidden_size;
# GPT-2: split_size): on a rank, its own share, so the forward reshapes to its own heads
LOCAL_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
                "n_head", "n_heads", "split_size", "hidden_size", "embed_dim", "all_head_size")


def is_conv1d(layer):
    """GPT-2's Conv1D (transformers.pytorch_utils): y = x W + b with W of shape (in, out),
    recognised without importing transformers."""
    return type(layer).__name__ == "Conv1D" and tuple(layer.weight.shape) == (layer.nx, layer.nf)


def features(layer):
    """(in_features, out_features) of an nn.Linear or a Conv1D."""
    return (layer.nx, layer.nf) if is_conv1d(layer) else (layer.in_features, layer.out_features)


def _matches(pattern, name):
    """fnmatch atom by atom ("blocks.*.mlp.fc1": * stands for one name, as in torch)."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(map(fnmatch.fnmatchcase, parts, atoms))


def plan_for(module, plan):
    """The entries of `plan` that name some module of `module` (e.g. a pipeline stage, which
    holds only some of the model's layers)."""
    names = [name for name, _ in module.named_modules() if name]
    return {pattern: style for pattern, style in plan.items()
            if any(_matches(pattern, name) for name in names)}


def _config_heads(root):
    config = getattr(root, "config", None)
    return {a: getattr(config, a) for a in CONFIG_HEADS
            if isinstance(getattr(config, a, None), int)}


def fused_parts(name, layer, root=None):
    """The sizes of the parts a colwise split cuts one by one (module doc): (out,) for a
    plain layer, q|k|v sizes for a fused projection; one-line ValueError for a layout that
    looks fused and is not known."""
    leaf = name.rsplit(".", 1)[-1]
    inp, out = features(layer)
    if leaf in PAIRS and out % 2 == 0:
        return (out // 2,) * 2
    if leaf in PER_HEAD and out == 3 * inp:
        return (out,)
    if leaf in QKV_BLOCKS:
        heads = _config_heads(root)
        h, kv = heads.get("num_attention_heads"), heads.get("num_key_value_heads", None)
        head_dim = getattr(getattr(root, "config", None), "head_dim", None) or (
            inp // h if h else None)
        if h and (h + 2 * (kv or h)) * head_dim == out:    # sizes from the config (GQA)
            return (h * head_dim, (kv or h) * head_dim, (kv or h) * head_dim)
        if out == 3 * inp:     # q, k and v each as wide as the input (GPT-2, labkit)
            return (out // 3,) * 3
    if LOOKS_FUSED.search(leaf):
        raise ValueError(f"{name} ({type(layer).__name__}, {inp} -> {out}) looks like a fused "
                         "projection in a layout labkit does not know: a contiguous colwise "
                         "split would mix its parts; plan its parts separately")
    return (out,)


def localize_attention(module, targets, tp):
    """Divide the head counts an attention module stores (LOCAL_COUNTS) by `tp` in each
    parent of the layers `targets` ([(name, style)]) splits by heads: its forward then reshapes
    to this rank's heads. Parents of other styles keep theirs: a vocab split's parent is the
    model (Bloom's builds ALiBi from its num_heads), a gathered output's whole heads."""
    parents = {name.rpartition(".")[0] for name, style in targets if style in HEAD_SPLITTING}
    for parent_name in parents:
        parent = module.get_submodule(parent_name)
        if not _is_attention(parent):
            continue
        for attr in LOCAL_COUNTS:
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(parent, attr, value // tp)
        if _config_heads(parent):   # its forward may read the config (Phi-3's q|k|v offsets)
            parent.config = _local_config(parent.config, tp)


def _local_config(config, tp):
    """A copy of a Hugging Face config with this rank's heads (the head size kept), for one
    attention module; the model's own config stays whole (set the attention implementation
    before parallelize: the copies keep the one they were made with)."""
    heads = _config_heads(types.SimpleNamespace(config=config))
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads["num_attention_heads"])
    local = copy.copy(config)
    for attr, value in heads.items():
        setattr(local, attr, value // tp)
    try:
        local.head_dim = head_dim
    except AttributeError:   # a read-only property: hidden_size / heads (Falcon's config)
        raise ValueError(f"{type(config).__name__} computes head_dim from hidden_size and the "
                         "head count, so a per-rank copy with 1/tp of the heads would get heads "
                         "tp times too wide: this model family cannot be split by heads here "
                         "(leave its attention out of the plan)") from None
    return local


def _is_attention(module):
    return hasattr(module, "head_dim") or hasattr(module, "head_size") or any(
        isinstance(getattr(module, a, None), int) for a in HEAD_COUNTS)


def refuse_sequence_parallel(module):
    """One-line ValueError for sequence parallelism on a Hugging Face model (module doc of
    tensor_parallel: every region between the split layers must run on sequence shards)."""
    for name, sub in module.named_modules():
        if getattr(getattr(sub, "config", None), "model_type", None):
            raise ValueError(f"sequence_parallel=True on {type(sub).__name__}: Hugging Face "
                             "models build positions, the causal mask and their attention's "
                             "reshape from the sequence length they are handed, so sequence "
                             "shards would fail or be wrong; use sequence_parallel=False")


def resolve_plan(module, plan, tp):
    """[(name, style)] of the modules `plan` names; one ValueError for anything that cannot
    work with a TP degree of `tp` (checked before any weight is touched)."""
    if not isinstance(plan, dict) or not plan:
        raise ValueError("plan must be a non-empty dict {module name glob: style}")
    named = {name: m for name, m in module.named_modules() if name}
    chosen = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}] = {style!r}: the style must be one of "
                             f"{', '.join(STYLES)}")
        hits = [name for name in named if _matches(pattern, name)]
        if not hits:
            raise ValueError(f"plan key {pattern!r} matches no module of "
                             f"{type(module).__name__} (it has: {', '.join(list(named)[:12])})")
        for name in hits:
            if chosen.setdefault(name, style) != style:
                raise ValueError(f"{name} is planned both {chosen[name]} and {style}")
    for name, style in chosen.items():
        check_layer(name, named[name], style, tp, module)
    return list(chosen.items())


@torch.no_grad()
def acts_as_linear(layer):
    """Whether an nn.Linear subclass's own forward computes nn.Linear's (Falcon's FalconLinear:
    x @ W.T + b), on a random input, within labkit.numerics' rounding rule: then a split, which
    computes F.linear, changes nothing."""
    if layer.weight.is_meta:   # nothing to run it on: not known to be a Linear
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, layer.in_features, generator=generator).to(layer.weight)
    bias = layer.bias
    exact = F.linear(x.double(), layer.weight.double(), None if bias is None else bias.double())
    return bool(numerics.compare(layer(x), F.linear(x, layer.weight, bias), exact))


def uses_alibi(root):
    """Whether a Hugging Face model adds ALiBi slopes per head (Bloom always; Falcon, MPT when
    their config says so)."""
    config = getattr(root, "config", None)
    return bool(getattr(config, "model_type", None) in ALIBI_FAMILIES
                or getattr(config, "alibi", False)
                or getattr(getattr(config, "attn_config", None), "alibi", False))


def _check_heads(name, parent_name, parent, tp, root):
    """The refusals of a split by heads: ALiBi, per-head module lists, heads tp does not
    divide."""
    counts = {a: getattr(parent, a) for a in HEAD_COUNTS
              if isinstance(getattr(parent, a, None), int)}
    if not _is_attention(parent):
        return counts
    if uses_alibi(root):
        raise ValueError(f"{name}: {type(root).__name__} uses ALiBi, whose per-head slopes the "
                         "model builds for all its heads outside the attention, where a split "
                         "by heads cannot slice them; leave its attention out of the plan "
                         "(split the MLP only)")
    counts.update({f"config.{a}": v for a, v in _config_heads(root).items()})
    for sub_name, sub in parent.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub) in set(counts.values()):
            raise ValueError(f"{parent_name}.{sub_name} is a list of {len(sub)} per-head "
                             f"modules ({type(sub[0]).__name__}): after a split by heads the "
                             "model would pair this rank's heads with the list's first ones; "
                             "leave its attention out of the plan")
    return counts


def check_layer(name, layer, style, tp, root):
    """One-line ValueError when `style` cannot split `layer` (`name` in `root`) over `tp`."""
    if style == "replicated_grad_sum":
        if not any(p.requires_grad for p in layer.parameters()):
            raise ValueError(f"'replicated_grad_sum' on {name} ({type(layer).__name__}): it has "
                             "no trainable parameter whose gradient to sum")
        return
    kinds = (nn.Linear, nn.Embedding) if style == "vocab" else (nn.Linear,)
    if isinstance(layer, nn.Linear) and type(layer).forward is not nn.Linear.forward \
            and not acts_as_linear(layer):
        raise ValueError(f"{name} is a {type(layer).__name__}, an nn.Linear subclass whose own "
                         f"forward is not nn.Linear's: a {style!r} split would replace it with a "
                         "plain matmul; leave it out of the plan")
    if not (isinstance(layer, kinds) or (style != "vocab" and is_conv1d(layer))):
        allowed = " or ".join("nn." + k.__name__ for k in kinds)
        raise ValueError(f"{style!r} applies to {allowed}; {name} is of type "
                         f"{type(layer).__name__}" + ("" if style == "vocab" else
                                                      " (GPT-2's Conv1D works too)"))
    parent_name = name.rpartition(".")[0]
    if style in HEAD_SPLITTING:
        counts = _check_heads(name, parent_name, root.get_submodule(parent_name), tp, root)
        for attr, heads in counts.items():   # an attention module: each rank gets whole heads
            if heads % tp:
                raise ValueError(f"TP degree {tp} does not divide {attr}={heads} of "
                                 f"{parent_name or 'the root'} (each rank computes whole heads)")
    if isinstance(layer, nn.Embedding):
        if layer.max_norm is not None or layer.sparse or layer.scale_grad_by_freq:
            raise ValueError(f"'vocab' cannot split {name}: max_norm, sparse and "
                             "scale_grad_by_freq need the whole table")
        size, what = layer.num_embeddings, "rows (vocabulary)"
    elif style == "vocab":
        size, what = layer.out_features, "output features (vocabulary)"
    elif style in ("rowwise", "rowwise_split"):
        size, what = features(layer)[0], "input features"
    elif style == "colwise_gather":   # gathered whole: a fused layer needs no part-by-part cut
        size, what = features(layer)[1], "output features"
    else:
        parts = fused_parts(name, layer, root)
        bad = [p for p in parts if p % tp]
        size = bad[0] if bad else parts[0]
        what = "output features" + (f" of one of its {len(parts)} fused parts"
                                    if len(parts) > 1 else "")
    if size % tp:
        raise ValueError(f"TP degree {tp} does not divide the {size} {what} of {name} "
                         f"({style} splits them across ranks)")


def gpt_plan(sequence_parallel=False, vocab=True, sequential=False):
    """Megatron's plan for labkit's GPT: attention split by heads (the fused qkv colwise, the
    output projection rowwise), the MLP colwise then rowwise, embedding and head by vocabulary
    (`vocab=False`: both whole, as serving keeps them). With sequence parallelism the position
    table is split by rows too: its reduce-scatter hands each rank the rows of its own slice of
    the sequence. `sequential`: by the names of `TinyGPT.as_sequential()` (stage modules keep
    them: "0" embeddings, "1".."L" blocks, "L+1" final norm + head), for pipelines."""
    blocks, embeddings, head = ("*.", "0.", "*.") if sequential else ("blocks.*.", "", "")
    plan = {f"{embeddings}tok": "vocab"} if vocab else {}
    plan.update({f"{blocks}attn.qkv": "colwise", f"{blocks}attn.proj": "rowwise",
                 f"{blocks}mlp.fc1": "colwise", f"{blocks}mlp.fc2": "rowwise"})
    if vocab:
        plan[f"{head}head"] = "vocab"
    if sequence_parallel:
        plan[f"{embeddings}pos"] = "vocab"
    return plan
