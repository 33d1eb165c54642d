"""Closed-form memory per GPU, in bytes: model states (ZeRO) and activations (Korthikanti).

Mixed-precision Adam holds 2Ψ weights + 2Ψ grads + 12Ψ optimizer state; ZeRO stage 1/2/3
divides optimizer / +grads / +weights by the data-parallel size. Activations: sbh(34 + 5as/h).
"""
from __future__ import annotations

from . import catalog
from .plan_inputs import count
from .weights import weight_bytes

# Bytes per element. Torch dtypes are accepted through str(), e.g. torch.bfloat16.
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5, "fp8": 1}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
                  "half": "fp16", "qint8": "int8", "uint8": "int8", "float8": "fp8",
                  "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}

# Optimizer-state bytes per parameter (ZeRO's K). With mixed precision the fp32 master copy of
# the weights (4 bytes) is optimizer state too; Adam adds fp32 momentum and variance (4 + 4).
OPTIMIZER_K = {
    (True, "adam"): 12, (True, "momentum"): 8, (True, "sgd"): 4,
    (False, "adam"): 8, (False, "momentum"): 4, (False, "sgd"): 0,
}


def dtype_bytes(dtype) -> float:
    """Bytes per element for 'bf16', 'fp32', 'int4', torch.float16, ..."""
    s = str(dtype).lower().replace("torch.", "")
    s = _DTYPE_ALIASES.get(s, s)
    if s not in BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(BYTES)}")
    return BYTES[s]


def model_state_bytes(params, *, mixed_precision=True, optimizer="adam", zero_stage=0,
                      world_size=1, grad_bytes=None) -> dict:
    """Weights, gradients and optimizer state in bytes per rank (ZeRO, arXiv 1910.02054, sec. 3).

    Mixed precision: 2Ψ bf16 weights, 2Ψ bf16 grads, KΨ optimizer (K=12 for Adam: fp32 master
    weights, momentum, variance). fp32 only: 4Ψ weights, 4Ψ grads, K=8 for Adam. 'momentum' SGD
    keeps one fp32 buffer, plain 'sgd' none (plus the master copy under mixed precision).
    ZeRO stage 1 shards the optimizer state over world_size ranks, stage 2 also the gradients,
    stage 3 also the weights (exact float division).

    grad_bytes: bytes per gradient when they differ from the weights'. ZeRO's paper counts 16
    bytes per parameter (bf16 gradients); Megatron-LM and FSDP2 keep fp32 main gradients
    (`--accumulate-allreduce-grads-in-fp32`, reduce_dtype=float32): grad_bytes=4, 18 bytes in
    all. The planner uses 18.
    """
    opt = "adam" if optimizer.lower() in ("adam", "adamw") else optimizer.lower()
    if (bool(mixed_precision), opt) not in OPTIMIZER_K:
        raise ValueError(f"unknown optimizer {optimizer!r}; use 'adam', 'momentum' or 'sgd'")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage!r}")
    n = world_size
    w = 2 if mixed_precision else 4
    out = {
        "params": w * params / (n if zero_stage >= 3 else 1),
        "grads": (grad_bytes or w) * params / (n if zero_stage >= 2 else 1),
        "optimizer": OPTIMIZER_K[(bool(mixed_precision), opt)] * params
        / (n if zero_stage >= 1 else 1),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def zero_stage_table(params, world_size, mixed_precision=True, optimizer="adam"):
    """Bytes per rank for baseline DP and ZeRO stages 1-3 (ZeRO arXiv 1910.02054, Figure 1)."""
    import pandas as pd   # here, not at import: `memory` answers without pandas
    rows = []
    for stage, label in enumerate(["baseline", "stage 1", "stage 2", "stage 3"]):
        b = model_state_bytes(params, mixed_precision=mixed_precision, optimizer=optimizer,
                              zero_stage=stage, world_size=world_size)
        rows.append({"stage": label, "zero_stage": stage, **b})
    return pd.DataFrame(rows).set_index("stage")


def activation_bytes_per_layer(seq, batch, hidden, heads, *, tp=1, sequence_parallel=False,
                               recompute=False) -> float:
    """Activation bytes one transformer layer saves for backward (Korthikanti et al. 2022,
    arXiv 2205.05198, Table 2; 16-bit activations, 1-byte dropout masks, 4h GELU MLP).

    no parallelism:        sbh (34 + 5as/h)
    tensor parallel t:     sbh (10 + 24/t + 5as/(ht))
    tensor + sequence par: sbh/t (34 + 5as/h)
    recompute='selective': the 5as/h attention term is recomputed, so it drops out
    recompute=True/'full': only the layer input is kept, 2sbh (2sbh/t with sequence parallel)
    """
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    mode = {False: "none", None: "none", True: "full"}.get(recompute, recompute)
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be False, True, 'full' or 'selective', not {recompute!r}")
    if mode == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attn = 0 if mode == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def training_memory(model, *, batch, seq, mixed_precision=True, zero_stage=0, dp=1, tp=1, pp=1,
                    sequence_parallel=False, recompute=False, optimizer="adam") -> dict:
    """Bytes per GPU to train `model` with DP x TP x PP (and a ZeRO stage over the dp ranks).

    Model states: Ψ/(tp*pp) parameters per model-parallel rank (Megatron-LM), then ZeRO
    (arXiv 1910.02054) over dp. Activations: layers/pp * activation_bytes_per_layer for one
    micro-batch of `batch` sequences (Korthikanti et al. 2022, arXiv 2205.05198). Simplifications:
    embedding / logits activations are ignored, 1F1B's extra in-flight micro-batches are not
    counted, fp32 training doubles the 16-bit activation figure.
    """
    m = catalog.model(model)
    _check_counts(batch=batch, seq=seq, gpus=dp, tp=tp, pp=pp)
    if m.arch == "unet":
        raise ValueError(f"{m.display_name} is not a transformer LM: no activation formula; "
                         "use model_state_bytes(params) for its model states")
    states = model_state_bytes(m.param_count() / (tp * pp), mixed_precision=mixed_precision,
                               optimizer=optimizer, zero_stage=zero_stage, world_size=dp)
    per_layer = activation_bytes_per_layer(seq, batch, m.hidden, m.heads, tp=tp,
                                           sequence_parallel=sequence_parallel,
                                           recompute=recompute)
    activations = m.layers / pp * per_layer * (1 if mixed_precision else 2)
    out = {k: states[k] for k in ("params", "grads", "optimizer")}
    out["activations"] = activations
    out["total"] = states["total"] + activations
    return out


def inference_memory(model, *, batch, context, weight_dtype="bf16", kv_dtype="bf16",
                     tp=1, pp=1) -> dict:
    """Bytes per GPU to serve `model`: weights plus the KV cache (GQA aware).

    weights  = weights.weight_bytes(model, weight_dtype)["total"] / (tp*pp) (Megatron-LM
               sharding; quantised matrices with their scales, bf16 embeddings and norms)
    kv_cache = 2 * layers * kv_heads*head_dim * context * batch * bytes(kv_dtype)
               / (pp * min(tp, kv_heads))   (a KV head is replicated once tp > kv_heads)
    """
    m = catalog.model(model)
    _check_counts(batch=batch, seq=context, tp=tp, pp=pp)
    if m.arch == "unet" or dtype_bytes(weight_dtype) not in (0.5, 1, 2):
        weights = m.param_count() * dtype_bytes(weight_dtype) / (tp * pp)
    else:   # matrices at the precision + scales, embeddings and norms in bf16 (weights.py)
        name = {0.5: "int4", 1: "int8", 2: "bf16"}[dtype_bytes(weight_dtype)]
        name = "fp8" if str(weight_dtype).lower().startswith(("fp8", "float8")) else name
        weights = weight_bytes(m, name)["total"] / (tp * pp)
    kv = 0.0
    if m.arch != "unet":
        kv = (2 * m.layers * m.kv_heads * m.head_dim * context * batch * dtype_bytes(kv_dtype)
              / (pp * min(tp, m.kv_heads)))
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def _check_counts(**counts):
    """Each count a positive whole number within plan_inputs.LIMITS (a 320-digit --seq ends
    here in one line, not in an OverflowError)."""
    for name, value in counts.items():
        count("global_batch" if name == "batch" else name, value, f"--{name}")


def largest_trainable_params(gpu_memory_bytes, world_size, zero_stage, mixed_precision=True,
                             optimizer="adam") -> float:
    """Largest Ψ whose model states fit in gpu_memory_bytes per rank (ZeRO arXiv 1910.02054,
    Table 1); activations and buffers are ignored. A GPU object may be passed for the memory."""
    mem = getattr(gpu_memory_bytes, "memory_bytes", gpu_memory_bytes)
    per_param = model_state_bytes(1, mixed_precision=mixed_precision, optimizer=optimizer,
                                  zero_stage=zero_stage, world_size=world_size)["total"]
    return mem / per_param


def tiny_gpt_activation_bytes(*, layers, seq, batch, hidden, heads, vocab,
                              bytes_per_element=4, dropout=False) -> float:
    """Bytes autograd saves for backward in labkit's tiny GPT (`labkit.models.TinyGPT`).

    Korthikanti et al. 2022 (arXiv 2205.05198) count per layer, in elements: attention 5sbh
    (LN out, Q, K, V, proj input) + as^2b (softmax output), MLP 9sbh (input, 4h GELU input,
    4h GELU output), two LayerNorm inputs 2sbh: 16sbh + as^2b. Their 34sbh + 5as^2b is this in
    2 bytes plus 1-byte dropout masks (sbh + sbh + as^2b) and the attention dropout output.
    Outside the blocks: final LayerNorm input and head input (2sbh) and the log-softmax (bsV).
    LayerNorm statistics, the causal mask and token ids are left out (under 1% here).
    """
    s, b, h, a, B = seq, batch, hidden, heads, bytes_per_element
    per_layer = (16 * s * b * h + a * s * s * b) * B
    if dropout:
        per_layer += 2 * s * b * h + a * s * s * b + a * s * s * b * B
    return layers * per_layer + (2 * s * b * h + b * s * vocab) * B


def fp32_rank_bytes(params, activations, optimizer="adam", **extra) -> dict:
    """One rank's bytes when it trains `params` parameters in fp32: {params, grads, optimizer}
    (`model_state_bytes`: 4Ψ + 4Ψ + KΨ), the `activations` it saves for backward, `peak` and any
    `extra` categories (e.g. buffers=). `peak` adds them all: an upper bound, since backward
    frees activations while it fills in gradients."""
    states = model_state_bytes(params, mixed_precision=False, optimizer=optimizer)
    out = dict(params=states["params"], grads=states["grads"], optimizer=states["optimizer"],
               activations=activations)
    out["peak"] = sum(out.values()) + sum(extra.values())
    return dict(out, **extra)
