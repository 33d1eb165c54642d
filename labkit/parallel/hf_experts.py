"""A Hugging Face MoE block re-expressed as the layer `ExpertParallel` takes.

`ExpertParallel` needs a router that returns one logit per expert and a list of experts it can
hand out E/N to a rank. transformers has written its sparse MoE blocks (Mixtral's
`MixtralSparseMoeBlock`, Qwen2-MoE's `Qwen2MoeSparseMoeBlock`, with a shared expert) two ways:
  - until 4.5x: `gate` an nn.Linear (logits), `experts` an nn.ModuleList of expert MLPs;
  - now: `gate` a top-k router returning a tuple (logits, top-k weights, top-k indices) and
    `experts` one module holding every expert stacked in 3-D tensors, `gate_up_proj`
    (E, 2I, h) and `down_proj` (E, h, I).
`as_expert_layer(block)` gives both the same shape: `gate` (the block's own router; of a tuple
the logits are taken, so `output_router_logits` still records them), `experts` (a ModuleList;
the stacked format sliced into one module per expert, copies of the slices), `top_k`,
`norm_topk_prob`, `routed_scaling_factor`, `capacity_factor = None` (transformers drops no
token) and the shared expert: Qwen2-MoE's `shared_expert` gated by sigmoid(shared_expert_gate(x)),
DeepSeek-V2's `shared_experts` ungated.
Routing: softmax over the E logits, the top-k, renormalised to sum 1 when `norm_topk_prob`
(Mixtral always; Qwen2-MoE by its config; DeepSeek-V2 never in transformers 5), times
`routed_scaling_factor` (DeepSeek-V2). A routing option the adaptation does not compute
(group-limited top-k, a score-correction bias, sigmoid scores) is refused in one line naming
it; anything else it missed, the probe finds. Before it is used the adapted layer
is run beside the block on a probe batch; a block it cannot reproduce is refused in one line
naming the block, never run silently wrong. Parameter names: `experts.{e}.gate_up_proj`;
`stack_experts` turns a gathered state back into transformers' stacked names.
"""
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

PROBE_TOKENS = 64   # enough that every expert of a small block gets some tokens


def is_hf_module(module):
    return type(module).__module__.startswith("transformers.")


def router_logits(router, tokens):
    """The router's (T, E) logits: its output, or the first of the tuple a current transformers
    router returns (called as it is, so transformers' output recorders still see it)."""
    out = router(tokens)
    return out[0] if isinstance(out, tuple) else out


class StackedExpert(nn.Module):
    """Expert e of a stacked-format block: down(act(gate) * up), gate|up = gate_up_proj x."""

    def __init__(self, stacked, e):
        super().__init__()
        self.gate_up_proj = nn.Parameter(stacked.gate_up_proj.detach()[e].clone(),
                                         requires_grad=stacked.gate_up_proj.requires_grad)
        self.down_proj = nn.Parameter(stacked.down_proj.detach()[e].clone(),
                                      requires_grad=stacked.down_proj.requires_grad)
        self.act_fn = stacked.act_fn

    def forward(self, x):
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj)


class HFExpertLayer(nn.Module):
    """The duck-typed MoE layer (see the module docstring); forward is the single-device
    computation, used only to check the adaptation against the block."""

    def __init__(self, gate, experts, top_k, norm_topk_prob, shared=None, shared_gate=None,
                 routed_scaling_factor=1.0, shared_name="shared_expert"):
        super().__init__()
        self.gate, self.experts, self.top_k = gate, experts, top_k
        self.norm_topk_prob, self.capacity_factor = norm_topk_prob, None
        self.routed_scaling_factor = routed_scaling_factor
        # under the block's own attribute name, so parameter names stay the model's
        self.shared_name = shared_name
        setattr(self, shared_name, shared)
        self.shared_expert_gate = shared_gate

    def shared_forward(self, tokens):
        """The dense part added to the routed experts' output (zero without a shared expert)."""
        shared = getattr(self, self.shared_name)
        if shared is None:
            return torch.zeros_like(tokens)
        out = shared(tokens)
        return out if self.shared_expert_gate is None else \
            torch.sigmoid(self.shared_expert_gate(tokens)) * out

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = router_logits(self.gate, tokens).float().softmax(dim=-1)
        weight, expert = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        weight = weight * self.routed_scaling_factor
        out = self.shared_forward(tokens)
        for e, module in enumerate(self.experts):
            tok, slot = (expert == e).nonzero(as_tuple=True)
            if tok.numel():
                out = out.index_add(0, tok, module(tokens[tok]) * weight[tok, slot, None]
                                    .to(tokens.dtype))
        return out.view(x.shape)


def as_expert_layer(block):
    """`block` (a transformers sparse MoE block, either format) as an HFExpertLayer, checked
    against the block on a probe batch; one-line ValueError naming the block otherwise."""
    name = type(block).__name__
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if block.training and getattr(block, "jitter_noise", 0):
        raise ValueError(f"ExpertParallel: {name} multiplies its input by random jitter "
                         "(router_jitter_noise > 0) in training: set it to 0")
    top_k = getattr(block, "top_k", None) or getattr(gate, "top_k", None)
    if top_k is None or gate is None or not hasattr(gate, "weight"):
        raise ValueError(f"ExpertParallel: {name} is neither labkit's MoE layer (it names no "
                         "capacity_factor) nor a transformers block with a top-k gate it knows")
    _refuse_routing_it_cannot_compute(block, gate, name)
    norm = _first_setting("norm_topk_prob", True, block, gate, getattr(block, "config", None))
    if isinstance(experts, nn.ModuleList):
        expert_list = experts                        # the older format: used as they are
    elif {n for n, _ in experts.named_parameters()} == {"gate_up_proj", "down_proj"} \
            and experts.gate_up_proj.dim() == 3:
        expert_list = nn.ModuleList(StackedExpert(experts, e)
                                    for e in range(experts.gate_up_proj.shape[0]))
    else:
        raise ValueError(f"ExpertParallel: {name}'s experts ({type(experts).__name__}) are "
                         "neither a ModuleList nor stacked gate_up_proj/down_proj tensors")
    shared_name = "shared_experts" if hasattr(block, "shared_experts") else "shared_expert"
    scale = _first_setting("routed_scaling_factor", 1.0, gate, block)
    layer = HFExpertLayer(gate, expert_list, int(top_k), bool(norm),
                          getattr(block, shared_name, None),
                          getattr(block, "shared_expert_gate", None), float(scale), shared_name)
    _check_against(block, layer, name)
    return layer


def _first_setting(name, default, *holders):
    """`name` from the first of `holders` (block, router, config) that has it set."""
    for holder in holders:
        value = getattr(holder, name, None)
        if value is not None:
            return value
    return default


def _refuse_routing_it_cannot_compute(block, gate, name):
    """Routing options of transformers' routers that the adaptation (softmax, top-k,
    renormalise or not, scale) does not compute: refused by name, not left to the probe."""
    method = getattr(gate, "topk_method", None) or getattr(block, "topk_method", None)
    if method not in (None, "greedy"):
        raise ValueError(f"ExpertParallel: {name} routes with topk_method={method!r} (top-k "
                         "within the best expert groups); it computes only plain top-k "
                         "(topk_method='greedy')")
    if getattr(gate, "e_score_correction_bias", None) is not None:
        raise ValueError(f"ExpertParallel: {name}'s router adds a score-correction bias "
                         "(e_score_correction_bias, DeepSeek-V3's aux-free balancing) before "
                         "its top-k; it computes only softmax top-k")
    if getattr(getattr(block, "config", None), "scoring_func", "softmax") != "softmax":
        raise ValueError(f"ExpertParallel: {name} scores experts with "
                         f"{block.config.scoring_func}; it computes only softmax top-k")


@torch.no_grad()
def _check_against(block, layer, name):
    """Run the adapted layer beside the block on a probe batch (its own generator: the
    caller's random state is left alone); refuse when they differ."""
    ref = next(block.parameters())
    g = torch.Generator().manual_seed(0)
    hidden = layer.gate.weight.shape[-1]      # (E, h): checked to exist above
    x = torch.randn(1, PROBE_TOKENS, hidden, generator=g).to(ref.device, ref.dtype)
    expected = block(x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    try:
        got = layer(x)
    except (RuntimeError, TypeError, ValueError):    # an expert MLP with another signature
        got = None
    tol = 1e-4 if ref.dtype in (torch.float32, torch.float64) else 3e-2
    scale = expected.abs().max().item() + 1e-12
    if got is None or not (got - expected).abs().max().item() <= tol * scale:
        raise ValueError(f"ExpertParallel: {name} computes something its adaptation does not "
                         "reproduce (routing or expert MLP of an unknown kind)")


EXPERT_KEY = re.compile(r"^(.*\bexperts)\.(\d+)\.(gate_up_proj|down_proj)$")


def stack_experts(state):
    """{name: tensor} with `...experts.{e}.gate_up_proj` entries stacked back over e into
    transformers' `...experts.gate_up_proj` (E, ...) (the current format's names)."""
    out, stacks = {}, {}
    for key, value in state.items():
        match = EXPERT_KEY.match(key)
        if match is None:
            out[key] = value
        else:
            stacks.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = value
    for key, parts in stacks.items():
        out[key] = torch.stack([parts[e] for e in sorted(parts)])
    return out
