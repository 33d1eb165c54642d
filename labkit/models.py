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
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        return self.proj(causal_attention(q, k, v, self.heads))


def causal_attention(q, k, v, heads):
    """softmax(QK^T / sqrt(d)) V per head with a causal mask; (b, s, heads*d) in and out."""
    b, s, width = q.shape
    d = width // heads
    q, k, v = (t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return (probs @ v).transpose(1, 2).reshape(b, s, width)


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

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
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

    def forward(self, idx, targets=None):
        s = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


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
        return x if targets is None else F.mse_loss(x, targets)


def build(name="gpt", seed=0, **overrides):
    """A freshly initialised model: the same seed gives the same weights on every rank."""
    torch.manual_seed(seed)
    if name == "gpt":
        return TinyGPT(GPTConfig(**overrides))
    if name == "mlp":
        return MLP(**overrides)
    raise ValueError(f"unknown model {name!r}: use 'gpt' or 'mlp'")
