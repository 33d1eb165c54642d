"""Lesson 11's explorer: your own model's bytes per GPU under each technique, modelled.

The models are Hugging Face configs (read by `theory.hf_shape`, nothing downloaded); for each
technique and GPU count the bars are `theory.memory.training_memory` per GPU: weights,
gradients and Adam's states in mixed precision (2 + 4 + 12 bytes per parameter, ZeRO's stages
sharding the last two, then the first, over the data-parallel GPUs; TP dividing all three) and
the activations of one sequence (Korthikanti et al. 2022), against an H100's 80 GB. By default
attention runs as SDPA / FlashAttention does (Dao et al. 2022): the s x s attention scores are
never stored, so Korthikanti's 5as/h score term is left out (as in his selective recompute);
"eager" keeps them. All modelled; the figure says so.
"""
from __future__ import annotations

from ..theory import hardware, memory as tm
from ..theory.hf_shape import hf_shape
from ..theory.plan_inputs import parse_model
from .plots import fmt, memory_stack
from .widgets import explorer

TECHNIQUES = {"data parallel (DDP)": dict(zero_stage=0), "ZeRO-1": dict(zero_stage=1),
              "ZeRO-2": dict(zero_stage=2), "FullyShard (ZeRO-3)": dict(zero_stage=3),
              "tensor parallel": dict(tp=True)}
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)
# how attention runs: its words in the figure, and the activation term it keeps
ATTENTION = {"flash": "FlashAttention / SDPA (scores not kept)",
             "eager": "eager attention (scores kept)"}


def own_model_bytes(shape, technique, gpus, seq, attention="flash"):
    """{params, grads, optimizer, activations, total} per GPU (modelled), or a one-line reason
    (str) when the technique cannot split this model over `gpus` GPUs. attention "flash"
    stores no s x s scores (the term selective recompute drops), "eager" stores them."""
    m = parse_model(shape)
    how = TECHNIQUES[technique]
    scores = {"flash": "selective", "eager": False}[attention]
    if how.get("tp"):
        if m.heads % gpus or m.kv_heads % gpus:
            return (f"TP {gpus} does not divide the {m.heads} query / {m.kv_heads} KV heads "
                    "(parallelize would refuse it)")
        return tm.training_memory(m, batch=1, seq=seq, tp=gpus, recompute=scores)
    return tm.training_memory(m, batch=1, seq=seq, dp=gpus, zero_stage=how["zero_stage"],
                              recompute=scores)


def draw_own_model(ax, configs, model, technique, gpus, seq, attention="flash"):
    """One stacked bar per GPU count up to `gpus` for the chosen model and technique."""
    shape = hf_shape(configs[model])
    bars, reason = {}, None
    for n in [g for g in GPU_COUNTS if g <= gpus]:
        got = own_model_bytes(shape, technique, n, seq, attention)
        if isinstance(got, str):
            reason = got
            break
        bars[f"{n} GPU{'s' if n > 1 else ''}"] = got
    h100 = hardware.gpu("H100").memory_bytes
    memory_stack(bars, capacity={"H100 80 GB": h100}, ax=ax, unit="GB",
                 title=f"{model}, {technique}: bytes per GPU (modelled), one sequence of "
                       f"{seq:,} tokens, {ATTENTION[attention]}, no recompute")
    last = list(bars.values())[-1]["total"] if bars else None
    text = f"{model} ({parse_model(shape).param_count() / 1e9:.2f}B parameters): "
    text += (f"{fmt(last / 1e9)} GB per GPU on {list(bars)[-1]} (modelled)" if last else "")
    return text + (f"; {reason}" if reason else "")


def own_model_explorer(configs):
    """`configs`: {name: Hugging Face config}. Model, technique, GPUs, sequence -> bars."""
    import ipywidgets as widgets

    names = list(configs)
    controls = dict(
        model=widgets.Dropdown(options=names, value=names[0], description="model"),
        technique=widgets.Dropdown(options=list(TECHNIQUES), value="FullyShard (ZeRO-3)",
                                   description="technique"),
        gpus=widgets.SelectionSlider(options=GPU_COUNTS, value=8, description="GPUs"),
        seq=widgets.SelectionSlider(options=[2 ** k for k in range(9, 15)], value=4096,
                                    description="seq len"),
        attention=widgets.Dropdown(options={v: k for k, v in ATTENTION.items()},
                                   value="flash", description="attention"),
    )
    return explorer(controls, lambda ax, **v: draw_own_model(ax, configs, **v), figsize=(9, 4.6))
