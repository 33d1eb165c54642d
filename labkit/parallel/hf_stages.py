"""A Hugging Face decoder as a sequence of layers, so that a pipeline can cut it.

`split_into_stages` cuts an nn.Sequential. A transformers causal LM is not one: its forward
computes the rotary position embeddings and the causal mask once and hands them to every
decoder layer, and the loss head shares the embedding's weight when the config ties them.
`hf_as_sequential(model)` re-expresses the same modules (shared, not copied) as units that
each rebuild what they need from the activation alone, so any contiguous run of them is a stage:
  - embedding: Llama/Mistral/Qwen2 `embed_tokens`; GPT-2 `wte` + `wpe` (its positions here);
  - one unit per decoder layer: its position ids (arange over the activation's length, after
    what its cache holds), its rotary (cos, sin) from the model's `rotary_emb` (a buffer, no
    parameter, so every stage may use it) and its layer type's causal mask, all per stage;
  - the head: the final norm and `lm_head`.
Only model types whose forward is exactly that are taken (KNOWN_TYPES), and before use the
sequence is run beside the model's own forward on a probe; any other is refused in one line.
With a labkit `KVCache` (`PipelineGenerator`) each unit keeps transformers' own DynamicCache on
it (`kv_cache.hf_cache`), so the stages generate as the whole model does.

Tied weights (Press & Wolf 2017, arXiv 1608.05859: `lm_head.weight is embed_tokens.weight`):
when the embedding and the head land on different stages the head gets its own copy of the
weight, equal at the start; `tied` on every stage names it, and the pipeline all-reduces the two
gradients so both copies take the same step (Megatron-LM's embedding group, Shoeybi et al.
2019, arXiv 1909.08053): one vocab x hidden all-reduce per step between first and last stage.
"""
import torch
import torch.nn as nn

FAMILIES = "Llama/Mistral/Qwen2-style (model.embed_tokens, model.layers, model.norm) or GPT-2"
PROBE_TOKENS = 8    # the check against the model's own forward
# models whose forward is embedding, layers (rotary, causal mask), norm, head and nothing more,
# read in transformers' modeling files (Gemma's logit soft-capping, Cohere's logit scale are not)
KNOWN_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt2")


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
            y = self.layer(x, attention_mask=mask, position_ids=position_ids, cache=cache,
                           use_cache=cache is not None,
                           position_embeddings=self.rotary(x, position_ids=position_ids))
        if cache is not None:   # labkit's KVCache sees the same tensors (its bytes, its length)
            held = cache.layers[self.layer_idx]
            kv_cache.keys[id(self)] = held.keys.transpose(1, 2)      # (b, s, heads, d) views
            kv_cache.values[id(self)] = held.values.transpose(1, 2)
        return y


class _Head(nn.Module):
    """hidden -> logits: the final norm and the language-model head."""

    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x, kv_cache=None):
        return self.lm_head(self.norm(x))


def hf_as_sequential(model):
    """`model` (a transformers causal LM) as nn.Sequential(embedding, decoder layers..., head),
    its own modules; a one-line TypeError naming the model when its layout is not known."""
    name = type(model).__name__
    lm_head = getattr(model, "lm_head", None)
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if lm_head is None or body is None:
        raise TypeError(f"split_into_stages: {name} is a transformers model without a language-"
                        f"model head (lm_head) over a base model; it cuts {FAMILIES} causal LMs")
    config = model.config
    if getattr(config, "model_type", None) not in KNOWN_TYPES:
        raise TypeError(f"split_into_stages: {name} (model_type {config.model_type!r}) is not "
                        f"one it knows how to cut ({', '.join(KNOWN_TYPES)})")
    if config.model_type == "gpt2" and hasattr(body, "h"):
        embed = _Embedding(body.wte, body.wpe, body.drop)
        layers = [_Decoder(b, i, config, gpt2=True) for i, b in enumerate(body.h)]
        head = _Head(body.ln_f, lm_head)
    elif all(hasattr(body, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        embed = _Embedding(body.embed_tokens)
        layers = [_Decoder(b, i, config, rotary=body.rotary_emb)
                  for i, b in enumerate(body.layers[:config.num_hidden_layers])]
        head = _Head(body.norm, lm_head)
    else:
        raise TypeError(f"split_into_stages: {name} ({config.model_type}) has a layout it does "
                        f"not know; it cuts {FAMILIES} causal LMs")
    sequential = nn.Sequential(embed, *layers, head)
    _check_against(model, sequential, name)
    return sequential


@torch.no_grad()
def _check_against(model, sequential, name):
    """The layers on a probe of PROBE_TOKENS ids against the model's own forward (dropout
    off for the probe, the caller's train/eval state restored): a model whose forward does
    more than its layers (logit soft-capping, a logit scale, ...) is refused, not cut wrong."""
    was = model.training
    model.eval()
    try:
        ids = torch.arange(PROBE_TOKENS, device=model.device).unsqueeze(0) % \
            model.config.vocab_size
        expected = model(input_ids=ids, use_cache=False).logits
        got = sequential(ids)
    finally:
        model.train(was)
    tol = 1e-4 if expected.dtype in (torch.float32, torch.float64) else 3e-2
    if not (got - expected).abs().max().item() <= tol * (expected.abs().max().item() + 1e-12):
        raise TypeError(f"split_into_stages: {name}'s forward does more than its embedding, "
                        "layers and head (a logit scale or soft-capping?): it cannot be cut")


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
