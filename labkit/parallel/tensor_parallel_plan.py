"""Which layers a tensor-parallel plan names, and whether a TP degree can split them.

A plan is {module name glob: style}, as in PyTorch's `parallelize_module`: "colwise",
"rowwise" or "vocab" (labkit.parallel.tensor_parallel splits the layers). Globs match names
atom by atom ("blocks.*.mlp.fc1": `*` stands for one name). `resolve_plan` checks everything
before any weight is touched: the style fits the layer's type, the degree divides the features
it splits (whole heads for attention, q, k and v part by part for a fused `qkv`).
"""
import fnmatch

import torch.nn as nn

STYLES = ("colwise", "rowwise", "vocab")
FUSED_QKV = ("qkv",)        # leaf names of a fused q|k|v projection: split part by part
HEAD_COUNTS = ("heads", "num_heads", "n_head", "num_attention_heads")


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


def fused_parts(name, module):
    """3 for a fused q|k|v projection (split part by part), else 1."""
    leaf = name.rsplit(".", 1)[-1]
    return 3 if leaf in FUSED_QKV and module.out_features % 3 == 0 else 1


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
        _check_one(name, named[name], style, tp, module)
    return list(chosen.items())


def _check_one(name, layer, style, tp, root):
    kinds = (nn.Linear, nn.Embedding) if style == "vocab" else (nn.Linear,)
    if not isinstance(layer, kinds):
        raise ValueError(f"{style!r} applies to {' or '.join('nn.' + k.__name__ for k in kinds)}"
                         f"; {name} is of type {type(layer).__name__}")
    parent_name = name.rpartition(".")[0]
    for attr in HEAD_COUNTS:   # an attention module: each rank must get whole heads
        heads = getattr(root.get_submodule(parent_name), attr, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(f"TP degree {tp} does not divide {attr}={heads} of "
                             f"{parent_name or 'the root'} (each rank computes whole heads)")
    if isinstance(layer, nn.Embedding):
        if layer.max_norm is not None or layer.sparse or layer.scale_grad_by_freq:
            raise ValueError(f"'vocab' cannot split {name}: max_norm, sparse and "
                             "scale_grad_by_freq need the whole table")
        size, what = layer.num_embeddings, "rows (vocabulary)"
    elif style == "rowwise":
        size, what = layer.in_features, "input features"
    elif style == "vocab":
        size, what = layer.out_features, "output features (vocabulary)"
    else:
        parts = fused_parts(name, layer)
        size = layer.out_features // parts
        what = "output features" + (" of each of q, k, v" if parts == 3 else "")
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
