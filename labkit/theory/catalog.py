"""Real model shapes from labkit/tables/models.csv, and parameter counts derived from them.

Llama layer: attention 2h^2 + 2h*(kv_heads*head_dim), SwiGLU MLP 3*h*ffn (x experts for MoE,
plus a router h*experts), two RMSNorms 2h; embeddings V*h (a second V*h head unless tied).
"""
from __future__ import annotations

import csv
import functools
import re
from dataclasses import dataclass

from .hardware import TABLES

MODELS_CSV = TABLES / "models.csv"


@dataclass(frozen=True)
class ModelShape:
    name: str
    display_name: str
    arch: str               # 'gpt2', 'llama', 'mixtral' or 'unet'
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    experts: int = 1
    top_k: int = 1
    tied_embeddings: bool = False
    max_seq: int = 2048
    params_published: float | None = None
    active_params_published: float | None = None
    source: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def _embedding_params(self) -> int:
        h, V = self.hidden, self.vocab
        return V * h * (1 if self.tied_embeddings else 2)

    def _attention_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv          # q, o: h x h; k, v: h x (kv_heads * head_dim)

    def _count(self, experts_used: int) -> int:
        h, L = self.hidden, self.layers
        if self.arch == "unet":
            return int(self.params_published)
        if self.arch == "gpt2":
            # Radford et al. 2019: learned positions, LayerNorm (w+b), biases, 4h MLP, tied head.
            attn = h * 3 * h + 3 * h + h * h + h    # fused qkv + bias, out proj + bias
            mlp = h * self.ffn + self.ffn + self.ffn * h + h
            norms = 2 * 2 * h
            embed = self.vocab * h + self.max_seq * h
            return embed + L * (attn + mlp + norms) + 2 * h   # + final LayerNorm
        # llama / mixtral: no biases, RMSNorm weight only, SwiGLU (gate, up, down).
        mlp = 3 * h * self.ffn * experts_used
        router = h * self.experts if self.experts > 1 else 0
        per_layer = self._attention_params() + mlp + router + 2 * h
        return self._embedding_params() + L * per_layer + h   # + final RMSNorm

    def param_count(self) -> int:
        """Total parameters derived from the shapes (Llama 3 / Mixtral / GPT-2 papers' layouts)."""
        return self._count(self.experts)

    def active_param_count(self) -> int:
        """Parameters used per token: only top_k experts' MLPs count (Switch Transformer,
        arXiv 2101.03961; Mixtral, arXiv 2401.04088)."""
        if self.arch == "unet":
            return int(self.active_params_published or self.params_published)
        return self._count(min(self.top_k, self.experts))


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", str(name).lower())


def _int(s: str, default=0) -> int:
    return int(float(s)) if s.strip() else default


def _float(s: str):
    return float(s) if s.strip() else None


@functools.lru_cache(maxsize=None)
def _models() -> dict:
    out = {}
    with MODELS_CSV.open(newline="") as f:
        for r in csv.DictReader(f):
            out[r["name"]] = ModelShape(
                name=r["name"], display_name=r["display_name"], arch=r["arch"],
                layers=_int(r["layers"]), hidden=_int(r["hidden"]), heads=_int(r["heads"]),
                kv_heads=_int(r["kv_heads"]), ffn=_int(r["ffn"]), vocab=_int(r["vocab"]),
                experts=_int(r["experts"], 1), top_k=_int(r["top_k"], 1),
                tied_embeddings=r["tied_embeddings"].strip().lower() in ("true", "1", "yes"),
                max_seq=_int(r["max_seq"]),
                params_published=_float(r["params_published"]),
                active_params_published=_float(r["active_params_published"]),
                source=r["source"],
            )
    return out


_ALIASES = {  # normalised alias -> slug
    "gpt2": "gpt2-small", "gpt2124m": "gpt2-small", "llama38b": "llama-3-8b",
    "llama370b": "llama-3-70b", "llama3405b": "llama-3.1-405b", "llama405b": "llama-3.1-405b",
    "mixtral": "mixtral-8x7b", "mixtral8b": "mixtral-8x7b",  # the source article's name
    "sd15": "stable-diffusion-1.5",
    "stablediffusion": "stable-diffusion-1.5", "sd": "stable-diffusion-1.5",
}


def model(name) -> ModelShape:
    """Look up a model: 'llama-3-70b', 'Llama 3 70B', 'mixtral-8x7b', 'gpt2', 'sd-1.5' ..."""
    if isinstance(name, ModelShape):
        return name
    by_key = {}
    for m in _models().values():
        by_key[_norm(m.name)] = m
        by_key[_norm(m.display_name)] = m
    key = _norm(name)
    key = _norm(_ALIASES.get(key, key))
    if key in by_key:
        return by_key[key]
    raise KeyError(f"unknown model {name!r}; known: {', '.join(_models())}")


def models() -> list[ModelShape]:
    return list(_models().values())


def table():
    """The models CSV as a DataFrame, with derived total and active parameter counts."""
    import pandas as pd   # here, not at import: `plan` and `memory` answer without pandas
    with MODELS_CSV.open() as f:
        df = pd.read_csv(f)
    df["params_derived"] = [model(n).param_count() for n in df["name"]]
    df["active_params_derived"] = [model(n).active_param_count() for n in df["name"]]
    return df
