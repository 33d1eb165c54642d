"""What the planner accepts: model shapes, `--fix` fields and counts, each checked up front.

Every mistake ends as one ValueError naming the option and the value (the CLI prints it in one
line, exit 2): an unknown or malformed field, a shape no transformer has (heads that do not
divide hidden, kv_heads that do not divide heads, top_k above the experts), a count that is not
a positive integer or lies beyond what any cluster has (a 320-digit batch is refused before it
reaches float arithmetic), a model that is not a transformer LM. Divisors come from the prime
factorisation, so a billion GPUs (2^9 5^9: 100 divisors) is answered at once.
"""
from __future__ import annotations

import functools

from . import catalog

# Upper bounds: far beyond any real run, low enough that float arithmetic never overflows.
LIMITS = {"gpus": 10**9, "gpus_per_node": 1024, "global_batch": 10**9, "seq": 2**24,
          "global_batch_tokens": 10**13, "top": 10**6, "layers": 10**5, "hidden": 2**20,
          "heads": 2**14, "kv_heads": 2**14, "ffn": 2**22, "vocab": 2**24, "experts": 2**14,
          "top_k": 2**14, "dp": 10**9, "tp": 2**14, "pp": 10**5, "cp": 2**14, "ep": 2**14,
          "v": 10**5, "micro_batch_size": 2**20, "recompute_layers": 10**5}
SHAPE_KEYS = ("layers", "hidden", "heads", "ffn", "vocab", "kv_heads", "experts", "top_k",
              "tied", "arch", "seq")
ARCHS = {"gpt": "gpt2", "gpt2": "gpt2", "llama": "llama", "mixtral": "mixtral"}
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")
RECOMPUTE = ("none", "selective", "full")
STACKS = ("megatron", "megatron-2021", "fsdp2", "deepspeed", "llama3")
PRECISIONS = ("bf16", "fp8", "fp32")
FP8_RECIPES = ("delayed", "current")   # Transformer Engine's per-tensor scaling recipes
FIX_FIELDS = ("dp", "tp", "pp", "cp", "ep", "v", "micro_batch_size", "zero_stage", "recompute",
              "recompute_layers", "sequence_parallel")


def count(name, value, option=None, minimum=1):
    """`value` as an int in [minimum, LIMITS[name]], else a ValueError naming `option`."""
    option = option or f"--{name.replace('_', '-')}"
    if isinstance(value, bool) or not isinstance(value, int):
        text = str(value).strip()
        if not text.lstrip("+-").isdigit():
            raise ValueError(f"{option} must be a whole number, got {str(value)[:40]!r}")
        if len(text) > 30:
            raise ValueError(f"{option} is out of range ({len(text)} digits; at most "
                             f"{LIMITS.get(name, 10**9):,})")
        value = int(text)
    if value < minimum:
        raise ValueError(f"{option} must be at least {minimum}, got {value}")
    if value > LIMITS.get(name, 10**9):
        raise ValueError(f"{option} must be at most {LIMITS.get(name, 10**9):,}, got "
                         f"{_short(value)}")
    return value


def _short(value):
    text = str(value)
    return text if len(text) <= 20 else f"a {len(text)}-digit number"


def boolean(value, option):
    """'true'/'false' (and 1/0, yes/no) as a bool; anything else is refused."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise ValueError(f"{option} must be true or false, got {str(value)[:40]!r}")


def choice(value, options, option):
    if value not in options:
        raise ValueError(f"{option} must be one of {', '.join(options)}, got "
                         f"{str(value)[:40]!r}")
    return value


@functools.lru_cache(maxsize=4096)
def divisors(n):
    """All divisors of n, ascending, from its prime factorisation (fast for n up to 1e9)."""
    factors, p, rest = {}, 2, n
    while p * p <= rest:
        while rest % p == 0:
            factors[p] = factors.get(p, 0) + 1
            rest //= p
        p += 1 if p == 2 else 2
    if rest > 1:
        factors[rest] = factors.get(rest, 0) + 1
    out = [1]
    for prime, power in factors.items():
        out = [d * prime ** e for d in out for e in range(power + 1)]
    return tuple(sorted(out))


def check_shape(m):
    """A ModelShape the planner can model, or a ValueError that says why not."""
    if m.arch == "unet":
        raise ValueError(f"{m.display_name} is a {m.arch.upper()}, not a transformer language "
                         "model: the planner models transformer layers (attention + MLP) only")
    if m.arch not in ARCHS.values():
        raise ValueError(f"{m.display_name}: unknown architecture {m.arch!r}; use "
                         f"{', '.join(ARCHS)}")
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k"):
        count(key, getattr(m, key), f"model {key}")
    if m.hidden % m.heads:
        raise ValueError(f"model heads={m.heads} must divide hidden={m.hidden}")
    if m.heads % m.kv_heads:
        raise ValueError(f"model kv_heads={m.kv_heads} must divide heads={m.heads}")
    if m.top_k > m.experts:
        raise ValueError(f"model top_k={m.top_k} exceeds experts={m.experts}")
    return m


def parse_model(text):
    """A catalog name, a ModelShape, or 'layers=..,hidden=..,heads=..,ffn=..,vocab=..[,...]'.

    A shape string is a Llama-family model (SwiGLU, RMSNorm) unless ffn == 4*hidden with no
    kv_heads, or arch=gpt is given: then it is a GPT (GELU MLP, tied embeddings, 2048 positions).
    """
    if isinstance(text, catalog.ModelShape):
        return check_shape(text)
    if "=" not in str(text):
        try:
            return check_shape(catalog.model(text))
        except KeyError as error:
            raise ValueError(f"--model: {error.args[0]}") from None
    fields = {}
    for part in str(text).split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if key not in SHAPE_KEYS or not sep:
            raise ValueError(f"--model: unknown shape field {key!r}; use "
                             f"{', '.join(SHAPE_KEYS)}")
        fields[key] = value
    missing = [k for k in ("layers", "hidden", "heads", "ffn", "vocab") if k not in fields]
    if missing:
        raise ValueError(f"--model: shape needs {', '.join(missing)} (e.g. layers=48,"
                         "hidden=6144,heads=64,ffn=24576,vocab=51200)")
    num = {k: count(k, v, f"--model {k}") for k, v in fields.items() if k not in ("tied", "arch")}
    arch = ARCHS[choice(fields["arch"], tuple(ARCHS), "--model arch")] if "arch" in fields \
        else ("gpt2" if num["ffn"] == 4 * num["hidden"] and "kv_heads" not in num else "llama")
    tied = boolean(fields.get("tied", str(arch == "gpt2")), "--model tied")
    experts = num.get("experts", 1)
    return check_shape(catalog.ModelShape(
        name="custom", display_name=str(text), arch="mixtral" if experts > 1 else arch,
        layers=num["layers"], hidden=num["hidden"], heads=num["heads"],
        kv_heads=num.get("kv_heads", num["heads"]), ffn=num["ffn"], vocab=num["vocab"],
        experts=experts, top_k=num.get("top_k", 1), tied_embeddings=tied,
        max_seq=num.get("seq", 2048)))


def parse_fix(text):
    """'dp=64,tp=8,recompute=full,sequence_parallel=true' (or a dict) -> {field: value}, each
    value checked; a mistake names the option, e.g. "--fix tp: must be a whole number"."""
    pairs = text.items() if isinstance(text, dict) else \
        [p.partition("=")[::2] for p in filter(None, (text or "").split(","))]
    out = {}
    for key, value in pairs:
        key = str(key).strip()
        option = f"--fix {key}"
        if key not in FIX_FIELDS:
            raise ValueError(f"--fix: unknown field {key!r}; use {', '.join(FIX_FIELDS)}")
        value = value.strip() if isinstance(value, str) else value
        if value == "":
            raise ValueError(f"{option}: give a value ({key}=...)")
        if key == "recompute":
            out[key] = choice(value, RECOMPUTE, option)
        elif key == "sequence_parallel":
            out[key] = boolean(value, option)
        elif key == "zero_stage":
            out[key] = count(key, value, option, minimum=0)
            if out[key] > 3:
                raise ValueError(f"{option} must be 0, 1, 2 or 3, got {out[key]}")
        else:
            out[key] = count(key, value, option, minimum=0 if key == "recompute_layers" else 1)
    return out
