"""Expert tensor parallelism (ETP): inside `ExpertParallel`, each expert's MLP split over a TP
group as a dense MLP is, so a mesh with tp > 1 and ep > 1 holds 1/(ep tp) of the experts.

The idea (Megatron-Core's MoE with expert_tensor_parallel_size = tensor_model_parallel_size,
its default; the split of an MLP from Shoeybi et al. 2019, arXiv 1909.08053): an expert's first
linear is split by output features ("colwise": rank i holds rows i of W1 and b1), its last by
input features ("rowwise": columns i of W2), so rank i computes the partial sum
    y_i = act(x W1_i^T + b1_i) W2_i^T,   y = sum_i y_i + b2.
Every rank of the TP group sees the same tokens (after the sequence-parallel all-gather when SP
is on), so the router, run replicated, makes the same choices on each, the ep all-to-all
carries the same rows on each, and the partial outputs are summed over tp once, at the MoE
layer's output, where the dense MLP's row-parallel reduction is (`enter` / `leave`: the f and
g of parallel/mappings.py, or SP's all-gather and reduce-scatter along the sequence).

What is partial, and so summed over TP. The gate weights multiply each rank's partial expert
outputs, so the router's gradient on one TP rank is its part of the sum (as a replicated
parameter under sequence parallelism is): a hook sums it over the group (`sum_grads_over_tp`;
SP's own hook, if `parallelize` put one there already, is that hook). Each rank adds b2 / tp
(Megatron divides the expert bias by tp likewise), and b2's gradient, 1/tp of the whole on each
rank, is summed by the same hook. The router's own losses (Switch's aux loss, the z-loss) are
computed alike on every TP rank: `once_over_tp` passes 1/tp of their gradient.

Memory per rank: E/ep experts of (2 h f + f) / tp + h parameters each (a GELU expert; 3 h f /
tp for a SwiGLU one), + the replicated router (h E). Communication per MoE layer and
micro-batch, per rank: on TP the dense MLP's (an all-reduce of the layer's T h values forward,
one backward; SP: all-gather + reduce-scatter along the sequence each way), + the router's
and the local experts' b2 gradients summed (h E + E/ep h values); on EP the same all-to-alls
as without TP (T k h values each, every TP rank carrying the same rows).
"""
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mappings import SEQUENCE_DIM, all_reduce_copy, copy_to, gather_along, reduce_from, \
    scatter_along
from .tensor_parallel_plan import resolve_plan
from .tp_shards import shard

EXPERT_PLAN = {"fc1": "colwise", "fc2": "rowwise"}   # labkit's Expert (models.Expert)


class ExpertSlice(nn.Module):
    """This TP rank's slice of one nn.Linear of an expert, with no collective of its own (the
    MoE layer sums over TP once): colwise holds rows i of the weight and of the bias; rowwise
    columns i of the weight, and adds bias / tp (the TP sum adds the bias once)."""

    def __init__(self, linear, group, style):
        super().__init__()
        self.style, self.tp = style, group.size
        self.weight = shard(linear.weight, group, 0 if style == "colwise" else 1)
        self.bias = shard(linear.bias, group, 0) if style == "colwise" else linear.bias

    def forward(self, x):
        if self.style == "colwise":
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias / self.tp

    def extra_repr(self):
        return f"{self.style}, this rank's weight {tuple(self.weight.shape)}, tp={self.tp}"


def split_layer(layer, experts, group, plan, tag):
    """An MoE layer made expert-tensor-parallel over `group`, in place: its `experts` (this
    EP rank's) split (`split_experts`), hooks summing over TP the gradients of the router and
    of the experts' unsplit parameters (the row biases). A shared expert is refused."""
    if hasattr(layer, "shared_forward") and getattr(layer, "shared_expert", True) is not None:
        raise ValueError("ExpertParallel(tp_group=...): a shared expert is not split over TP "
                         "here; use tp_group=None")
    split_experts(experts, group, plan)
    router = [(n, p) for n, p in layer.named_parameters() if not n.startswith("experts.")]
    biases = [(f"experts.{i}.{n}", p) for i, e in enumerate(experts)
              for n, p in e.named_parameters() if getattr(p, "tp_split", None) is None]
    sum_grads_over_tp(router + biases, group, tag)


def split_experts(experts, group, plan=None):
    """Each expert's Linears that `plan` names ({name: "colwise" | "rowwise"}; None: labkit's
    EXPERT_PLAN) replaced by this rank's `ExpertSlice`, in place; one-line ValueError (before
    any weight is cut) for an expert the plan does not fit or a degree that does not divide."""
    plan = EXPERT_PLAN if plan is None else plan
    if set(plan.values()) - {"colwise", "rowwise"}:
        raise ValueError(f"expert_plan styles must be colwise or rowwise, got {plan}")
    targets = [resolve_plan(expert, plan, group.size) for expert in experts]
    for expert, names in zip(experts, targets):
        for name, _ in names:
            if not isinstance(expert.get_submodule(name), nn.Linear):
                raise ValueError(f"expert tensor parallelism splits nn.Linear layers; the "
                                 f"expert's {name} is a {type(expert.get_submodule(name))}")
    for expert, names in zip(experts, targets):
        for name, style in names:
            parent, _, leaf = name.rpartition(".")
            holder = expert.get_submodule(parent)
            holder._modules[leaf] = ExpertSlice(holder._modules[leaf], group, style)


def sum_grads_over_tp(params, group, tag):
    """A hook on each parameter summing its gradient over the TP group (each rank holds a part
    of it, module docstring), unless one does already (`_tp_sum`: SP's, tensor_parallel.py)."""
    for name, p in params:
        if p.requires_grad and not getattr(p, "_tp_sum", False):
            p.register_hook(partial(all_reduce_copy, group=group, tag=f"{tag} grad {name}"))
            p._tp_sum = True


def enter(x, group, sequence_parallel, tag):
    """The MoE layer's input as every TP rank sees it: SP's sequence shards all-gathered
    (backward: reduce-scatter), else f (identity; backward: the partial gradients summed)."""
    if sequence_parallel:
        return gather_along(x, group, f"{tag} (tp in)", SEQUENCE_DIM)
    return copy_to(x, group, f"{tag} (tp in)")


def leave(out, group, sequence_parallel, tag):
    """The partial outputs summed over TP: g (all-reduce), or SP's reduce-scatter along the
    sequence (each rank keeps its shard)."""
    if sequence_parallel:
        return scatter_along(out, group, f"{tag} (tp out)", SEQUENCE_DIM)
    return reduce_from(out, group, f"{tag} (tp out)")


def once_over_tp(x, tp):
    """x's value, 1/tp of its gradient: what every TP rank computes alike (the router's losses)
    and whose gradient the TP sums would otherwise count tp times."""
    if tp == 1 or not x.requires_grad:
        return x
    y = x.clone()
    y.register_hook(lambda grad: grad / tp)
    return y
