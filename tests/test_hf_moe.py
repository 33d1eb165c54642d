"""Expert parallelism on Hugging Face MoE blocks built from tiny configs (random weights, never
downloaded): `ExpertParallel` takes transformers' current Mixtral and Qwen2-MoE blocks (experts
stacked in 3-D tensors, a router returning a tuple; Qwen2-MoE with its shared expert and
norm_topk_prob=False) and the older format (an nn.ModuleList of expert MLPs and an nn.Linear
gate; `LegacyMixtralBlock` below is transformers 4.46's MixtralSparseMoeBlock, written out
because the installed version no longer has it), and DeepSeek-V2's (its `shared_experts`
ungated, the top-k not renormalised (norm_topk_prob=False), a routed_scaling_factor). On 2
ranks, each with half the batch, 2 SGD steps leave the gathered parameters within rounding of
the unwrapped model trained on the whole batch on one device (labkit.numerics); greedy
`generate` through the EP model gives the single-device tokens. A block the adaptation does
not reproduce, and a routing option it does not compute, are refused in one line.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import numerics
from labkit.parallel.hf_experts import stack_experts
from labkit.parallel.moe import ExpertParallel, average_moe_gradients, full_parameters

transformers = pytest.importorskip("transformers")

KINDS = ("mixtral", "qwen2_moe", "mixtral_legacy", "deepseek_v2")
AUX = ("mixtral", "qwen2_moe")   # current routers: transformers records their logits
VOCAB, SEQ, BATCH, STEPS, LR = 128, 8, 4, 2, 0.5


class LegacyExpert(nn.Module):
    """transformers 4.46 MixtralBlockSparseTop2MLP: w2(act(w1 x) * w3 x)."""

    def __init__(self, gate_up, down, act):
        super().__init__()
        inner = down.shape[1]
        self.w1, self.w3 = (nn.Linear(down.shape[0], inner, bias=False) for _ in range(2))
        self.w2 = nn.Linear(inner, down.shape[0], bias=False)
        self.w1.weight.data, self.w3.weight.data = gate_up[:inner].clone(), gate_up[inner:].clone()
        self.w2.weight.data, self.act_fn = down.clone(), act

    def forward(self, hidden_states):
        return self.w2(self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


class LegacyMixtralBlock(nn.Module):
    """transformers 4.46 MixtralSparseMoeBlock (ModuleList experts, nn.Linear gate), made from
    a current block's weights; it returned (hidden, router_logits), which the current decoder
    layer cannot take, so this one returns the hidden states alone."""

    def __init__(self, block):
        super().__init__()
        self.top_k, self.num_experts = block.top_k, block.experts.num_experts
        self.gate = nn.Linear(block.gate.hidden_dim, self.num_experts, bias=False)
        self.gate.weight.data = block.gate.weight.detach().clone()
        self.experts = nn.ModuleList(
            LegacyExpert(block.experts.gate_up_proj.detach()[e], block.experts.down_proj
                         .detach()[e], block.experts.act_fn) for e in range(self.num_experts))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros_like(hidden_states)
        mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            idx, top_x = torch.where(mask[e])
            out = self.experts[e](hidden_states[None, top_x].reshape(-1, h))
            final.index_add_(0, top_x, out * routing_weights[top_x, idx, None])
        return final.reshape(b, s, h)


def build(kind, experts=None):
    """experts: transformers' experts_implementation (None: its default, grouped_mm, which
    has no float64 kernel; the float64 reference runs the "eager" loop)."""
    torch.manual_seed(0)
    t = transformers
    common = dict(experts_implementation=experts, vocab_size=VOCAB, hidden_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2)
    if kind.startswith("deepseek_v2"):   # "deepseek_v2 grouped": group-limited top-k
        grouped = dict(topk_method="group_limited_greedy", n_group=2, topk_group=1) \
            if kind.endswith("grouped") else {}
        cfg = t.DeepseekV2Config(intermediate_size=64, moe_intermediate_size=16,
                                 n_routed_experts=4, n_shared_experts=1, norm_topk_prob=False,
                                 routed_scaling_factor=1.5, first_k_dense_replace=0,
                                 kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                                 qk_rope_head_dim=8, v_head_dim=8, **grouped,
                                 **{**common, "num_key_value_heads": 4})   # MLA: kv = q heads
    elif kind == "qwen2_moe":
        cfg = t.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                               shared_expert_intermediate_size=48, norm_topk_prob=False,
                               **common)
    else:
        cfg = t.MixtralConfig(intermediate_size=48, num_local_experts=4, **common)
    model = t.AutoModelForCausalLM.from_config(cfg)
    if kind == "mixtral_legacy":
        for layer in model.model.layers:
            layer.mlp = LegacyMixtralBlock(layer.mlp)
    return model


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(VOCAB, (BATCH, SEQ), generator=g)


def single_device(kind, dtype):
    model = build(kind, "eager" if dtype == torch.float64 else None).to(dtype)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids = batch(step)
        optim.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def greedy(model, prompt):
    return model.generate(prompt, do_sample=False, max_new_tokens=4, min_new_tokens=4,
                          attention_mask=torch.ones_like(prompt))[:, prompt.shape[1]:]


def aux_loss(model, ids):
    """transformers' load-balancing loss from the router logits it records."""
    with torch.no_grad():
        return model(input_ids=ids, output_router_logits=True).aux_loss.item()


def train_expert_parallel(ctx):
    """Per model: the greedy tokens of this rank's prompts (initial weights) and the gathered
    parameters after STEPS steps (each rank half the batch, its loss the mean over its
    tokens)."""
    out = {}
    half = slice(ctx.rank * BATCH // 2, (ctx.rank + 1) * BATCH // 2)
    for kind in KINDS:
        model = build(kind)
        for layer in model.model.layers:
            layer.mlp = ExpertParallel(layer.mlp)
        model.eval()                  # greedy tokens of the initial weights, then train
        tokens = greedy(model, batch(9)[half, :5])
        model.train()
        aux = aux_loss(model, batch(0)[half]) if kind in AUX else None
        optim = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(STEPS):
            ids = batch(step)[half]
            optim.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            average_moe_gradients(model, None)
            optim.step()
        out[kind] = dict(params=stack_experts(full_parameters(model)), tokens=tokens, aux=aux)
    return out


@pytest.fixture(scope="module")
def runs():
    return labkit.launch(train_expert_parallel, 2, timeout_s=600)


@pytest.mark.parametrize("kind", KINDS)
def test_training_with_hf_experts_equals_one_device(runs, kind):
    parallel = runs[0][kind]["params"]
    single, exact = single_device(kind, torch.float32), single_device(kind, torch.float64)
    assert set(parallel) == set(exact)
    assert numerics.compare(runs[1][kind]["params"], single, exact), "ranks disagree"
    agreement = numerics.compare(parallel, single, exact)
    assert agreement, f"{kind}: {agreement}"
    start = build(kind).state_dict()
    assert max((single[n] - start[n]).abs().max().item() for n in single) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_generation_through_expert_parallel_equals_one_device(runs, kind):
    expected = greedy(build(kind).eval(), batch(9)[:, :5])
    assert torch.equal(torch.cat([runs[0][kind]["tokens"], runs[1][kind]["tokens"]]), expected)


@pytest.mark.parametrize("kind", AUX)
def test_router_logits_still_recorded_for_the_aux_loss(runs, kind):
    """The EP layer calls the block's own router, so output_router_logits still sees each
    rank's logits: each rank's aux loss is the one-device model's on that rank's tokens."""
    single, exact = build(kind), build(kind, "eager").double()
    for rank in range(2):
        ids = batch(0)[rank * BATCH // 2:(rank + 1) * BATCH // 2]
        expected = aux_loss(single, ids)
        assert expected > 0
        assert numerics.compare_loss([runs[rank][kind]["aux"]], [expected],
                                     [aux_loss(exact, ids)])


def test_block_it_cannot_reproduce_refused_in_one_line():
    model = build("mixtral")
    block = model.model.layers[0].mlp

    class ScaledMixtralSparseMoeBlock(type(block)):
        def forward(self, hidden_states):      # a block that does something else
            return 2 * super().forward(hidden_states)

    block.__class__ = ScaledMixtralSparseMoeBlock
    with pytest.raises(ValueError, match="ScaledMixtralSparseMoeBlock computes something") as e:
        ExpertParallel(block)       # refused before it looks for a process group
    assert "\n" not in str(e.value)
    block.__class__ = ScaledMixtralSparseMoeBlock.__bases__[0]
    block.train()
    block.jitter_noise = 0.01
    with pytest.raises(ValueError, match="MixtralSparseMoeBlock multiplies its input by random"):
        ExpertParallel(block)


def test_routing_option_it_does_not_compute_refused_by_name():
    """DeepSeek-V2's group-limited top-k: named in one line, before any process group."""
    block = build("deepseek_v2 grouped").model.layers[0].mlp
    with pytest.raises(ValueError, match="DeepseekV2Moe routes with topk_method="
                                         "'group_limited_greedy'") as err:
        ExpertParallel(block)
    assert "\n" not in str(err.value)
