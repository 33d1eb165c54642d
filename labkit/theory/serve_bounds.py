"""Lower bounds on a `run serve`'s memory and time on the machine it runs on, from its shape
alone (runs/serve_fit.py measures the machine's rates and refuses a run past them).

Memory (bytes, a lower bound; float32, kv_heads = heads, the tiny GPT of runs/serve.py):

    per rank  = 4Ψ (every rank builds the whole model before it keeps its part)
              + KV cache  2 · L/pp · B/(replicas·ep) · (P + T - 1) · h/tp · 4
              + attention scores of the prefill  2 · (B/(replicas·ep)/pp) · H/tp · P² · 4
                (causal_attention materialises QKᵀ and its softmax: two P x P per head)
              + a CPU rank's Python + torch + gloo (`per_process`)
    reference = 4Ψ + its KV cache + 2 · B · H · P² · 4 + the prefill's logits B · P · V · 4
              + the logits it returns B · T · V · 4          (run after the ranks end)
    need      = max(world_size x per rank, reference) <= MemAvailable

Time (seconds, a lower bound for the ranks and again for the reference on one device):

    work  = 2 · N_matmul · B · (P + T - 1)        (2 FLOPs per weight a token passes;
                                                 the last token is never fed back)
          + 4 · L · h · B · (P² + (T-1)·P + T(T-1)/2)
                                                (QKᵀ and AV over the prompt, then the cache)
    moved = T · 4Ψ  +  2 · L · B · h · 4 · ((T-1)·P + T(T-1)/2)
                                                (each decode step reads the weights and the
                                                 whole KV cache so far: decoding is memory-bound)
    time  = work / R  +  moved / W  +  T · L · t_layer  +  L · t_build

R: the FLOP/s of a matmul on this machine; W: the bytes per second a large copy reads;
t_layer: a one-token forward of one block (every generated token passes every layer, one after
the other, at least this long each); t_build: building one block (`MachineRates`, measured by
runs/serve_fit.py, upper bounds on the rates, so the time is a lower bound).
FLOP counts: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1 (2N per
token forward, plus the attention's 2·L·n_ctx·d per token for QKᵀ and again for AV).
`cfg`: a serve config (runs/serve.ServeConfig: batch, prompt_len, new_tokens, tp, pp, ep,
replicas, experts, top_k, world_size and gpt_config(), the model's shape).
"""
import math
from dataclasses import dataclass

from . import serving as theory

BYTES = 4   # float32
SCORE_COPIES = 2   # QKᵀ and its softmax alive at once in models.causal_attention


@dataclass(frozen=True)
class MachineRates:
    """What the time bound needs of the machine: FLOP/s of matmuls, bytes/s a copy reads,
    seconds of a one-token block forward, to build a small block, per initialised weight."""
    flops_per_s: float
    read_bytes_per_s: float
    layer_s: float
    build_s: float
    init_s_per_weight: float


def parameters(cfg):
    """Ψ of the model `cfg` serves, from its shape alone (no module is built)."""
    c = cfg.gpt_config()
    n = c.param_count()
    if cfg.experts > 1:   # each MoE layer holds `experts` MLPs where the dense GPT has one
        n += (cfg.experts - 1) * c.layers * (2 * c.hidden * c.ffn + c.ffn + c.hidden)
    return n


def memory(cfg, per_process):
    """{per_rank, ranks, reference, need, parts}: the bytes of the docstring's formula, with
    `per_process` bytes for each rank's Python, torch and gloo."""
    c = cfg.gpt_config()
    share = cfg.replicas * cfg.ep
    weights = BYTES * parameters(cfg)
    kv = theory.cached_kv_bytes(layers=math.ceil(c.layers / cfg.pp),
                                requests=cfg.batch // share, prompt_len=cfg.prompt_len,
                                new_tokens=cfg.new_tokens, hidden=c.hidden, tp=cfg.tp,
                                bytes_per_value=BYTES)
    micro = max(1, cfg.batch // share // cfg.pp)
    scores = SCORE_COPIES * micro * max(1, c.heads // cfg.tp) * cfg.prompt_len ** 2 * BYTES
    per_rank = weights + kv + scores + per_process
    reference = (weights + theory.cached_kv_bytes(
        layers=c.layers, requests=cfg.batch, prompt_len=cfg.prompt_len,
        new_tokens=cfg.new_tokens, hidden=c.hidden, bytes_per_value=BYTES)
        + SCORE_COPIES * cfg.batch * c.heads * cfg.prompt_len ** 2 * BYTES
        + cfg.batch * (cfg.prompt_len + cfg.new_tokens) * c.vocab * BYTES)
    ranks = cfg.world_size * per_rank
    return dict(per_rank=per_rank, ranks=ranks, reference=reference,
                need=max(ranks, reference),
                parts=dict(weights=weights, kv_cache=kv, scores=scores))


def work_flops(cfg):
    """FLOPs of one greedy generation of the whole batch (the docstring's `work`)."""
    c = cfg.gpt_config()
    k = max(1, cfg.top_k) if cfg.experts else 1
    router = c.hidden * cfg.experts   # the MoE router's logits (0 for the dense GPT)
    matmul = c.layers * (4 * c.hidden ** 2 + k * 2 * c.hidden * c.ffn + router) \
        + c.hidden * c.vocab
    b, p, t = cfg.batch, cfg.prompt_len, cfg.new_tokens
    return (2 * matmul * b * (p + t - 1)
            + 4 * c.layers * c.hidden * b * (p * p + (t - 1) * p + t * (t - 1) // 2))


def bytes_moved(cfg):
    """Bytes the decode steps read at least (the docstring's `moved`)."""
    c = cfg.gpt_config()
    b, p, t = cfg.batch, cfg.prompt_len, cfg.new_tokens
    return (t * BYTES * parameters(cfg)
            + 2 * c.layers * b * c.hidden * BYTES * ((t - 1) * p + t * (t - 1) // 2))


def seconds(cfg, rates: MachineRates):
    """{seconds, flops, rate, moved, read, layer_s}: the docstring's lower bound for one
    generation at the machine's `rates`."""
    c = cfg.gpt_config()
    flops, moved = work_flops(cfg), bytes_moved(cfg)
    build = c.layers * rates.build_s + parameters(cfg) * rates.init_s_per_weight
    total = (flops / rates.flops_per_s + moved / rates.read_bytes_per_s
             + cfg.new_tokens * c.layers * rates.layer_s + build)
    return dict(seconds=total, flops=flops, rate=rates.flops_per_s, moved=moved,
                read=rates.read_bytes_per_s, layer_s=rates.layer_s)
