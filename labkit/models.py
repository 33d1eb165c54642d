"""Small deterministic models every technique runs: an MLP and a tiny GPT.

The GPT is written out op by op (no fused attention), so what autograd saves per block is
exactly what `theory.memory.tiny_gpt_activation_bytes` counts: 16sbh + as^2b elements (fp32,
no dropout) - the Korthikanti et al. 2022 accounting without the dropout masks.
"""
import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    ffn: int = 256

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must divide by heads ({self.heads})")

    def as_dict(self):
        return asdict(self)

    def param_count(self):
        """Weights and biases, from the shapes (checked against the model in the tests)."""
        h, f = self.hidden, self.ffn
        block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        return self.vocab * h + self.seq * h + self.layers * block + 2 * h + h * self.vocab


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x, kv_cache=None):
        # q|k|v by thirds, heads from the width: a tensor-parallel rank holds some whole heads
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if kv_cache is not None:   # this step's keys and values join the cached ones
            k, v = kv_cache.update(self, k, v)
        return self.proj(causal_attention(q, k, v, q.shape[-1] // self.head_dim))


def causal_attention(q, k, v, heads):
    """softmax(QK^T / sqrt(d)) V per head with a causal mask; (b, s, heads*d) in and out.
    k and v may be longer than q (a KV cache): q's tokens are then the last ones.
    Overridable like a torch function (ContextParallel routes it to a context-parallel core)."""
    if has_torch_function((q, k, v)):
        return handle_torch_function(causal_attention, (q, k, v), q, k, v, heads)
    b, s, width = q.shape
    d, s_k = width // heads, k.shape[1]
    q = q.view(b, s, heads, d).transpose(1, 2)
    k, v = (t.view(b, s_k, heads, d).transpose(1, 2) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    mask = torch.ones(s, s_k, dtype=torch.bool, device=q.device).triu(1 + s_k - s)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return (probs @ v).transpose(1, 2).reshape(b, s, width)


def token_positions(idx, kv_cache=None):
    """Positions of the tokens `idx` (b, s): right after those the cache has seen (the cache
    counts them: `kv_cache.claim_positions(s)`, once per forward, by the embedding)."""
    start = 0 if kv_cache is None else kv_cache.claim_positions(idx.shape[1])
    return torch.arange(start, start + idx.shape[1], device=idx.device)


class MLPBlock(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLPBlock(cfg.hidden, cfg.ffn)

    def forward(self, x, kv_cache=None):
        x = x + self.attn(self.ln1(x), kv_cache=kv_cache)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + position embedding, `layers` pre-LN blocks, final LayerNorm, untied LM head."""

    def __init__(self, cfg=GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, idx, targets=None, positions=None, kv_cache=None):
        """Logits (or the loss with targets). Generation: pass a KV cache (e.g.
        `labkit.parallel.serving.KVCache`: `update(layer, k, v)`, `claim_positions(s)`); the
        first call (the prompt, "prefill") fills it, each later call adds one token per
        sequence ("decode"). positions: the tokens' positions (default: after those seen)."""
        if positions is None:
            positions = token_positions(idx, kv_cache)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x, kv_cache=kv_cache)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def as_sequential(self):
        """The same modules (shared, not copied) as an nn.Sequential from token ids to logits:
        embeddings, each block, final norm + head. Pipeline splitting cuts this list."""
        return nn.Sequential(_Embeddings(self.tok, self.pos), *self.blocks,
                             _NormHead(self.ln_f, self.head))


class _Embeddings(nn.Module):
    """TinyGPT's first step: token + position embedding (for `TinyGPT.as_sequential`)."""

    def __init__(self, tok, pos):
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx, kv_cache=None):
        return self.tok(idx) + self.pos(token_positions(idx, kv_cache))


class _NormHead(nn.Module):
    """TinyGPT's last step: final LayerNorm and LM head (for `TinyGPT.as_sequential`)."""

    def __init__(self, ln_f, head):
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x):
        return self.head(self.ln_f(x))


class MLP(nn.Module):
    """A stack of Linear + GELU layers with an MSE loss: the smallest thing worth parallelising."""

    def __init__(self, dims=(32, 64, 64, 32)):
        super().__init__()
        self.dims = tuple(dims)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x, targets=None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        if targets is None:
            return x
        t = torch.result_type(x, targets)   # as torch >= 2.12 promotes (2.11 refuses)
        return F.mse_loss(x.to(t), targets.to(t))


def build(name="gpt", seed=0, **overrides):
    """A freshly initialised model: the same seed gives the same weights on every rank."""
    torch.manual_seed(seed)
    if name == "gpt":
        return TinyGPT(GPTConfig(**overrides))
    if name == "mlp":
        return MLP(**overrides)
    if name == "moe":
        return build_moe(seed, **overrides)
    raise ValueError(f"unknown model {name!r}: use 'gpt', 'mlp' or 'moe'")


# ================================================================ Mixture of Experts (lesson 05)
# A single-process reference MoE: Router -> top-k -> capacity -> experts -> weighted combine.
# labkit.parallel.moe.ExpertParallel spreads its experts over ranks and must give the same
# answers (written separately there: the block does not import the models).

@dataclass(frozen=True)
class MoEConfig:
    """Conventions, stated once:

    capacity = ceil(capacity_factor * top_k * tokens_per_group / experts) slots per expert (for
    top_k = 1 this is Switch's capacity_factor * tokens / experts). A routing *group* (GShard) is
    the set of tokens whose capacity and queue order are decided together: the whole batch with
    groups = 1; with expert parallelism inside data parallelism, the tokens of one EP group.
    Queue order inside a group: all first choices before all second choices (GShard), and within
    one choice by token index. Assignments past the capacity are dropped; a token whose every
    choice is dropped passes through the residual unchanged.
    Gate weights: top-1 keeps the raw softmax probability (Switch, so the router gets a
    gradient from the main loss); top-k > 1 renormalises the k probabilities to sum to 1 (top-2:
    Mixtral).
    """
    experts: int = 4
    top_k: int = 1
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01     # Switch load-balancing loss weight (alpha)
    z_loss_coef: float = 1e-3       # router z-loss weight (ST-MoE, Zoph et al. 2022)
    expert_ffn: int = None          # an expert's hidden width; None: the GPT's ffn
    groups: int = 1
    dense: bool = False             # dense dispatch: every expert on every token, no capacity

    def __post_init__(self):
        if self.experts < 1:
            raise ValueError(f"an MoE layer needs at least 1 expert, got {self.experts}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be between 1 and the number of experts "
                             f"({self.experts}), got {self.top_k}")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")

    def capacity(self, tokens_per_group):
        return math.ceil(self.capacity_factor * self.top_k * tokens_per_group / self.experts)

    def as_dict(self):
        return asdict(self)


class Router(nn.Module):
    """A linear gate, no bias: one logit per expert for every token."""

    def __init__(self, hidden, experts):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)

    def forward(self, x):
        return self.gate(x)


class Expert(MLPBlock):
    """One expert is an ordinary MLP (fc1, GELU, fc2); an MoE layer holds `experts` of them."""


@dataclass
class Routing:
    """Where every (token, choice) of a chunk of tokens goes, and whether it fits."""
    expert: torch.Tensor     # (T, k) expert index of each choice
    weight: torch.Tensor     # (T, k) gate weight (differentiable)
    position: torch.Tensor   # (T, k) slot in that expert's queue, counted over the whole group
    kept: torch.Tensor       # (T, k) position < capacity
    capacity: int
    group_load: torch.Tensor  # (E,) assignments routed to each expert in the whole group
    aux_loss: torch.Tensor   # this chunk's share of the group's Switch loss
    z_loss: torch.Tensor     # mean over this chunk's tokens of logsumexp(logits)^2

    @property
    def dropped(self):
        return int((~self.kept).sum())


def top_k_gates(logits, k):
    """softmax over experts, the top-k experts and their gate weights (see MoEConfig)."""
    probs = logits.softmax(dim=-1)
    top_p, expert = probs.topk(k, dim=-1)
    weight = top_p / top_p.sum(dim=-1, keepdim=True) if k > 1 else top_p
    return probs, expert, weight


def choice_counts(expert, experts):
    """(k, E): how many tokens of this chunk chose expert e as their j-th choice."""
    return F.one_hot(expert, experts).sum(dim=0)


def queue_offsets(counts_by_chunk, chunk):
    """(k, E) assignments queued ahead of chunk `chunk`'s first token, for each choice, expert.

    counts_by_chunk (chunks, k, E) holds every chunk's choice_counts in token order (chunks are
    ranks of an EP group, or the one chunk of a single process). Ahead of choice j: every
    choice < j of the whole group, then choice j of the earlier chunks.
    """
    total = counts_by_chunk.sum(dim=0)
    return total.cumsum(dim=0) - total + counts_by_chunk[:chunk].sum(dim=0)


def queue_positions(expert, experts, offsets):
    """(T, k) slot of each (token, choice) in its expert's queue: offset + earlier tokens."""
    onehot = F.one_hot(expert, experts)                  # (T, k, E)
    earlier_here = onehot.cumsum(dim=0) - onehot         # same choice and expert, earlier token
    return ((earlier_here + offsets) * onehot).sum(dim=-1)


def switch_aux_loss(probs, group_load, group_tokens):
    """This chunk's share of E * sum_e f_e * P_e (Fedus et al. 2021, eq. 4): f_e the fraction of
    the group's assignments routed to e (no gradient), P_e the group's mean router probability;
    P_e is a sum over tokens, so the chunks' shares add up to the group's loss. 1.0 = balanced."""
    experts = probs.shape[-1]
    fraction = group_load.to(probs.dtype) / group_load.sum()
    return experts * (fraction * probs.sum(dim=0)).sum() / group_tokens


def router_z_loss(logits):
    """mean_t logsumexp(logits_t)^2 (ST-MoE, Zoph et al. 2022): keeps router logits small."""
    return logits.logsumexp(dim=-1).pow(2).mean()


class MoELayer(nn.Module):
    """Router + experts in one process: the reference that expert parallelism must reproduce.

    Experts live in a ModuleDict keyed by their global index, so a rank holding experts 2 and 3
    names them `experts.2`, `experts.3`, exactly as the full model does.
    """

    def __init__(self, hidden, ffn, moe=MoEConfig()):
        super().__init__()
        self.moe = moe
        self.router = Router(hidden, moe.experts)
        self.experts = nn.ModuleDict({str(e): Expert(hidden, moe.expert_ffn or ffn)
                                      for e in range(moe.experts)})
        self.aux_loss = self.z_loss = torch.zeros(())
        self.last = []    # the Routing of each group in the last forward

    def gate(self, tokens):
        logits = self.router(tokens)
        probs, expert, weight = top_k_gates(logits, self.moe.top_k)
        return logits, probs, expert, weight

    def assign(self, logits, probs, expert, weight, counts_by_chunk, chunk, group_tokens):
        """Capacity and queue slots from every chunk's counts: the same on every rank."""
        capacity = self.moe.capacity(group_tokens)
        position = queue_positions(expert, self.moe.experts, queue_offsets(counts_by_chunk, chunk))
        load = counts_by_chunk.sum(dim=(0, 1))
        return Routing(expert, weight, position, position < capacity, capacity, load,
                       switch_aux_loss(probs, load, group_tokens), router_z_loss(logits))

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        if self.moe.dense:
            return self.dense_forward(tokens).view(shape)
        outs, self.last = [], []
        for chunk in tokens.chunk(self.moe.groups):   # routing groups, in token order
            logits, probs, expert, weight = self.gate(chunk)
            counts = choice_counts(expert, self.moe.experts)[None]
            routing = self.assign(logits, probs, expert, weight, counts, 0, chunk.shape[0])
            outs.append(self.apply_experts(chunk, routing))
            self.last.append(routing)
        self.aux_loss = torch.stack([r.aux_loss for r in self.last]).mean()
        self.z_loss = torch.stack([r.z_loss for r in self.last]).mean()
        return torch.cat(outs).view(shape)

    def apply_experts(self, tokens, routing):
        """sum over kept choices of weight * expert(token); dropped choices add nothing."""
        out = torch.zeros_like(tokens)
        for name, expert in self.experts.items():
            tok, choice = ((routing.expert == int(name)) & routing.kept).nonzero(as_tuple=True)
            if tok.numel():
                y = expert(tokens[tok]) * routing.weight[tok, choice].unsqueeze(-1)
                out = out.index_add(0, tok, y)
        return out

    def dense_forward(self, tokens):
        """Every expert on every token, weighted by the top-k gates (zero elsewhere): no capacity,
        no drops. What capacity dispatch equals when the capacity factor is high enough."""
        logits, probs, expert, weight = self.gate(tokens)
        gates = torch.zeros_like(probs).scatter(1, expert, weight)
        self.aux_loss = switch_aux_loss(probs, choice_counts(expert, self.moe.experts).sum(0),
                                        tokens.shape[0])
        self.z_loss = router_z_loss(logits)
        self.last = []
        return sum(gates[:, int(name), None] * e(tokens) for name, e in self.experts.items())


class MoEGPT(TinyGPT):
    """TinyGPT with every block's MLP replaced by an MoELayer; the loss adds the router losses:
    cross-entropy + aux_loss_coef * sum_layers Switch loss + z_loss_coef * sum_layers z-loss."""

    def __init__(self, cfg=GPTConfig(), moe=MoEConfig()):
        super().__init__(cfg)
        self.moe = moe
        for block in self.blocks:
            block.mlp = MoELayer(cfg.hidden, cfg.ffn, moe)

    def moe_layers(self):
        return [block.mlp for block in self.blocks]

    def forward(self, idx, targets=None, positions=None, kv_cache=None):
        out = super().forward(idx, targets, positions, kv_cache)
        if targets is None:
            return out
        self.ce_loss = out.detach()
        layers = self.moe_layers()
        return (out + self.moe.aux_loss_coef * sum(m.aux_loss for m in layers)
                + self.moe.z_loss_coef * sum(m.z_loss for m in layers))


def build_moe(seed=0, moe=MoEConfig(), **overrides):
    """A freshly initialised MoEGPT (what `build('moe', ...)` would return)."""
    torch.manual_seed(seed)
    return MoEGPT(GPTConfig(**overrides), moe)
