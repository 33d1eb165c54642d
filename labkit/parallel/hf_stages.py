"""A Hugging Face decoder as a sequence of layers, so that a pipeline can cut it.

`split_into_stages` cuts an nn.Sequential. A transformers causal LM is not one: its forward
computes the rotary position embeddings and the causal mask once and hands them to every
decoder layer, and the loss head shares the embedding's weight when the config ties them.
`hf_as_sequential(model)` re-expresses the same modules (shared, not copied) as units that
each rebuild what they need from the activation alone, so any contiguous run of them is a stage:
  - embedding: the base model's input embedding; GPT-2 `wte` + `wpe` (its positions here);
  - one unit per decoder layer: its position ids (arange over the activation's length, after
    what its cache holds), its rotary (cos, sin) from the model's `rotary_emb` (a buffer, no
    parameter, so every stage may use it) and its layer type's causal mask, all per stage;
  - the head: the final norm (`norm`, `final_layernorm`, `ln_f`, ...) and `lm_head`.
No family list: before use the units of a miniature of the same class (the blocks' self-check
builds it from the model's own config) run beside its own forward on a probe, unit by unit;
a family whose forward does more (Gemma-2's logit soft-capping, a residual scale in the model's
loop) is refused in one line naming the first unit that differs (`probe`).
With a labkit `KVCache` (`PipelineGenerator`) each unit keeps transformers' own DynamicCache on
it (`kv_cache.hf_cache`), so the stages generate as the whole model does.

Tied weights (Press & Wolf 2017, arXiv 1608.05859: `lm_head.weight is embed_tokens.weight`):
when the embedding and the head land on different stages the head gets its own copy of the
weight, equal at the start; `tied` on every stage names it, and the pipeline all-reduces the two
gradients so both copies take the same step (Megatron-LM's embedding group, Shoeybi et al.
2019, arXiv 1909.08053): one vocab x hidden all-reduce per step between first and last stage.
"""
import inspect

import torch
import torch.nn as nn

from .. import numerics

FAMILIES = "Llama-style (embedding, decoder layers given rotary positions, final norm) or GPT-2"
PROBE_TOKENS = 8    # the check against the model's own forward
DECODED = 2         # of them, the last decoded one at a time through the units' cache
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


def is_hf_model(model):
    """Whether `model` looks like a transformers model (a PreTrainedModel with a config)."""
    return hasattr(model, "config") and hasattr(model, "base_model_prefix")


def _hf_cache(kv_cache, config):
    """transformers' DynamicCache kept on labkit's KVCache (one per stage and micro-batch)."""
    if kv_cache is None:
        return None
    if getattr(kv_cache, "hf_cache", None) is None:
        from transformers import DynamicCache
        kv_cache.hf_cache = DynamicCache(config=config)
    return kv_cache.hf_cache


def _positions(x, cache, layer_idx):
    past = 0 if cache is None else cache.get_seq_length(layer_idx)
    return torch.arange(past, past + x.shape[1], device=x.device).unsqueeze(0)


class _Embedding(nn.Module):
    """ids -> hidden: token embedding (+ learned positions, GPT-2)."""

    def __init__(self, tokens, positions=None, dropout=None):
        super().__init__()
        self.tokens, self.positions, self.dropout = tokens, positions, dropout

    def forward(self, ids, kv_cache=None):
        x = self.tokens(ids)
        if self.positions is not None:
            start = 0 if kv_cache is None else kv_cache.claim_positions(ids.shape[1])
            pos = torch.arange(start, start + ids.shape[1], device=ids.device)
            x = x + self.positions(pos).unsqueeze(0)
        return x if self.dropout is None else self.dropout(x)


class _Decoder(nn.Module):
    """One transformers decoder layer with what the model's forward would have handed it."""

    def __init__(self, layer, layer_idx, config, rotary=None, gpt2=False):
        super().__init__()
        self.layer, self.layer_idx, self.gpt2 = layer, layer_idx, gpt2
        # the rotary module holds buffers only; kept out of the module tree, shared by stages
        self.__dict__["rotary"], self.__dict__["config"] = rotary, config

    def _mask(self, x, cache, position_ids):
        from transformers import masking_utils as mu
        kind = (getattr(self.config, "layer_types", None) or [None] * (self.layer_idx + 1))
        sliding = (kind[self.layer_idx] == "sliding_attention" if kind[self.layer_idx]
                   else getattr(self.config, "sliding_window", None) is not None
                   and getattr(self.config, "use_sliding_window", True))
        make = mu.create_sliding_window_causal_mask if sliding else mu.create_causal_mask
        # layer_idx: this stage's cache holds only its own layers (not layer 0's lengths)
        return make(config=self.config, inputs_embeds=x, attention_mask=None, cache=cache,
                    position_ids=position_ids, layer_idx=self.layer_idx)

    def forward(self, x, kv_cache=None):
        cache = _hf_cache(kv_cache, self.config)
        position_ids = _positions(x, cache, self.layer_idx)
        mask = self._mask(x, cache, position_ids)
        if self.gpt2:
            y = self.layer(x, cache, mask, use_cache=cache is not None,
                           position_ids=position_ids)
        else:
            y = self.layer(x, attention_mask=mask, position_ids=position_ids,
                           use_cache=cache is not None, **{_cache_keyword(self.layer): cache},
                           position_embeddings=self.rotary(x, position_ids=position_ids))
        y = y[0] if isinstance(y, tuple) else y   # (hidden, attention weights): Falcon
        if cache is not None:   # labkit's KVCache sees the same tensors (its bytes, its length)
            held = cache.layers[self.layer_idx]
            kv_cache.keys[id(self)] = held.keys.transpose(1, 2)      # (b, s, heads, d) views
            kv_cache.values[id(self)] = held.values.transpose(1, 2)
        return y


def _cache_keyword(layer):
    """The name a decoder layer takes its cache by (`cache`; Falcon's `layer_past`; ...)."""
    names = inspect.signature(layer.forward).parameters
    return next((n for n in CACHE_KEYWORDS if n in names), "cache")


class _Head(nn.Module):
    """hidden -> logits: the final norm and the language-model head."""

    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x, kv_cache=None):
        return self.lm_head(self.norm(x))


NORMS = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")   # the final norm
LAYER_LISTS = ("layers", "h", "blocks")


def _units(model):
    """`model`'s own modules as (embedding, decoder units..., head), or a one-line reason why
    its layout is not one this module knows (a str)."""
    name = type(model).__name__
    lm_head = getattr(model, "lm_head", None)
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if lm_head is None or body is None:
        return (f"split_into_stages: {name} is a transformers model without a language-"
                f"model head (lm_head) over a base model; it cuts {FAMILIES} causal LMs")
    config = model.config
    layers = next((getattr(body, n) for n in LAYER_LISTS
                   if isinstance(getattr(body, n, None), nn.ModuleList)), None)
    norm = next((getattr(body, n) for n in NORMS if getattr(body, n, None) is not None), None)
    if layers is None or norm is None:
        return (f"split_into_stages: {name} ({config.model_type}) has no list of decoder "
                f"layers ({', '.join(LAYER_LISTS)}) and final norm ({', '.join(NORMS)}) on its "
                f"{type(body).__name__}; it cuts {FAMILIES} causal LMs")
    layers = layers[:config.num_hidden_layers]
    if hasattr(body, "wte") and hasattr(body, "wpe"):   # GPT-2: learned positions, no rotary
        return [_Embedding(body.wte, body.wpe, body.drop),
                *[_Decoder(b, i, config, gpt2=True) for i, b in enumerate(layers)],
                _Head(norm, lm_head)]
    rotary = getattr(body, "rotary_emb", None)
    if rotary is None:
        return (f"split_into_stages: {name} ({config.model_type}) has no rotary_emb to give "
                f"each stage its positions; it cuts {FAMILIES} causal LMs")
    return [_Embedding(body.get_input_embeddings()),
            *[_Decoder(b, i, config, rotary=rotary) for i, b in enumerate(layers)],
            _Head(norm, lm_head)]


def hf_as_sequential(model, verify=True):
    """`model` (a transformers causal LM) as nn.Sequential(embedding, decoder layers..., head),
    its own modules. Checked first on a miniature of the same class (`probe`; verify=False
    skips it); a one-line TypeError naming the model, and where it differs, otherwise."""
    units = _units(model)
    if isinstance(units, str):
        raise TypeError(units)
    if verify:
        probe(model)
    return nn.Sequential(*units)


class _OwnForwardFailed(Exception):
    """The model's own forward (not the units) raised on the probe."""


def _miniature(model):
    """A small model of `model`'s class (the blocks' self-check's, when it can build one),
    else `model` itself, in eval mode (no dropout: both runs must compute one function)."""
    from .self_check import SelfCheckError, miniature
    try:
        return miniature(model, seed=0).eval()
    except SelfCheckError:
        return model.eval()


@torch.no_grad()
def probe(model):
    """The stages' units against the model's own forward, on a miniature of its class (the
    whole sequence, PROBE_TOKENS ids, in float32 and float64: labkit.numerics' rule): the
    embedding, each decoder layer (the model's hidden states) and the logits. A family whose
    forward does more than its units (logit soft-capping, a logit scale, a residual scale
    in the model's loop) is refused in one line naming the first unit that differs. Returns
    {unit: Agreement}. Cost: the miniature's forward and its units' (whole, then DECODED
    tokens through the cache), in float32 and float64: 0.1-1 s measured on 2 busy CPU cores."""
    name = type(model).__name__
    was = model.training
    mini = _miniature(model)
    try:
        try:
            runs = [_unit_outputs(m, name) for m in (mini, numerics.exact_copy(mini))]
        except _OwnForwardFailed:
            if mini is model:
                raise
            # a miniature the model's own code cannot run (a config that does not shrink so)
            runs = [_unit_outputs(m, name) for m in (model, numerics.exact_copy(model))]
    except _OwnForwardFailed as error:
        raise TypeError(f"split_into_stages: {name}'s own forward fails on a probe "
                        f"({error}); it cannot be checked, so it is not cut") from None
    finally:
        model.train(was)
    (own, units), (exact, _) = runs   # the float64 model's own forward: the exact answer
    found = {}
    for unit in exact:
        if unit not in own or unit not in units:
            continue
        agreement = numerics.compare(units[unit], own[unit], exact[unit])
        found[unit] = agreement
        if not agreement:
            raise TypeError(f"split_into_stages: cut into its units, {name} differs from its "
                            f"own forward at {unit} ({agreement.error:.1e} vs float32's own "
                            f"{agreement.own_error:.1e}): its forward does more than its "
                            "embedding, layers and head, so it cannot be cut")
    return found


def _unit_outputs(model, name):
    """({unit: the model's own output there}, {unit: the units' output there}) on a probe."""
    units = _units(model)
    if isinstance(units, str):
        raise TypeError(units)
    ids = torch.arange(PROBE_TOKENS, device=model.device).unsqueeze(0) % model.config.vocab_size
    try:
        own = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    except Exception as error:   # noqa: BLE001 - told apart from the units' failures
        raise _OwnForwardFailed(f"{type(error).__name__}: "
                                f"{str(error).splitlines()[0][:100]}") from None
    hidden = getattr(own, "hidden_states", None) or ()
    expected = {f"the logits (after decoder layer {len(units) - 3}, the final norm and "
                "lm_head)": own.logits}
    layers = len(units) - 2
    if len(hidden) == layers + 1:   # the embedding, each layer but the last (then the norm)
        expected["the embedding"] = hidden[0]
        expected.update({f"decoder layer {i}": hidden[i + 1] for i in range(layers - 1)})
    expected["the logits decoded through the stages' cache"] = own.logits[:, -DECODED:]
    got = _run_units(units, ids, name, record=True)
    from .kv_cache import KVCache   # labkit's cache, as PipelineGenerator hands it over
    cache, start = KVCache(), PROBE_TOKENS - DECODED
    _run_units(units, ids[:, :start], name, cache)
    got["the logits decoded through the stages' cache"] = torch.cat(
        [_run_units(units, ids[:, i:i + 1], name, cache) for i in range(start, PROBE_TOKENS)],
        dim=1)
    return expected, got


def _run_units(units, ids, name, kv_cache=None, record=False):
    """The units in turn on `ids`: the logits, or ({unit: its output}) when `record`."""
    got, x, layers = {}, ids, len(units) - 2
    for index, unit in enumerate(units):
        where = ("the embedding" if index == 0 else "the head" if index == layers + 1
                 else f"decoder layer {index - 1}")
        try:
            x = unit(x) if kv_cache is None else unit(x, kv_cache=kv_cache)
        except Exception as error:   # noqa: BLE001 - any failure of a unit alone: refused
            raise TypeError(f"split_into_stages: {name}'s {where} does not run on its own "
                            f"({type(error).__name__}: {str(error).splitlines()[0][:100]}); "
                            "it cannot be cut") from None
        got[f"the logits (after decoder layer {layers - 1}, the final norm and lm_head)"
            if index == layers + 1 else where] = x
    return got if record else x


def untie_across_stages(stages):
    """When the embedding's weight is also the head's and they sit on different stages: give
    the head its own copy (equal values) and mark every stage's `tied` with the pair's name,
    so the pipeline sums their gradients. Returns the stages."""
    embed, head = stages[0][0], stages[-1][-1]
    tied = []
    if (len(stages) > 1 and isinstance(head, _Head) and isinstance(embed, _Embedding)
            and head.lm_head.weight is embed.tokens.weight):
        copy = nn.Linear(0, 0, bias=head.lm_head.bias is not None)
        copy.weight = nn.Parameter(embed.tokens.weight.detach().clone())
        copy.bias = head.lm_head.bias
        head.lm_head = copy
        tied.append(("embedding = lm_head", tuple(copy.weight.shape), copy.weight.dtype))
    for index, stage in enumerate(stages):
        stage.tied = [(name, shape, dtype, _tied_param(stage, index, len(stages)))
                      for name, shape, dtype in tied]
    return stages


def _tied_param(stage, index, count):
    if index == 0:
        return stage[0].tokens.weight
    return stage[-1].lm_head.weight if index == count - 1 else None


def sum_tied_gradients(stages, group, comm, device):
    """The tied pair's gradients summed over the pipeline group (every rank calls it; a rank
    holding neither sends zeros): each copy then holds the single-device weight's gradient."""
    entries = [e for s in stages for e in getattr(s.module, "tied", [])]
    if not entries:
        return
    for name, shape, dtype, _ in stages[0].module.tied:
        mine = [p for s in stages for n, *_, p in s.module.tied if n == name and p is not None]
        total = torch.zeros(shape, dtype=dtype, device=device)
        for p in mine:
            if p.grad is not None:
                total += p.grad
        total = comm.all_reduce(total, group=group, tag=f"pipeline tied grads ({name})")
        for p in mine:
            p.grad = total.clone()
