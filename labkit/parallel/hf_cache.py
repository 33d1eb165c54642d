"""Hugging Face causal LMs in `serving.generate`: their own KV cache, their own output.

A transformers model keeps the keys and values in its own cache object (DynamicCache: per layer
(b, kv_heads, tokens, head_dim) keys and values) that it takes as `past_key_values`
(transformers 4.x) or `cache` (5.x) together with `use_cache=True`, and it returns a
ModelOutput whose `.logits` are the logits and whose `.past_key_values` / `.cache` is the cache
to hand back next step. Fed one new token without that cache, it would attend to that token
alone: `generate` refuses such a forward instead of returning wrong tokens.

`HFCache` carries that object between the steps of `generate` and measures what it holds from
the tensors themselves (a TP rank's cache holds its own kv heads, a replica's its own requests):
    bytes = 2 x layers x b x tokens x kv_heads x head_dim x dtype bytes
(Pope et al. 2022, "Efficiently Scaling Transformer Inference", arXiv 2211.05102).
"""
import inspect

import torch

CACHE_ARGUMENTS = ("cache", "past_key_values")   # transformers 5.x renamed the 4.x argument


def cache_argument(module):
    """The name under which `module.forward` takes a Hugging Face cache (with `use_cache`),
    or None when it takes none."""
    params = inspect.signature(module.forward).parameters
    if "use_cache" not in params:
        return None
    return next((name for name in CACHE_ARGUMENTS if name in params), None)


class HFCache:
    """The Hugging Face cache a model returned, kept for its next step (None before the
    prompt): `generate` passes it back with use_cache=True; `nbytes()` counts its tensors."""

    def __init__(self):
        self.hf = None
        self._call = None    # (cache argument, extra keywords), read once from the signature

    def forward(self, model, ids):
        """Run `model` on the new ids with the cache so far; keep the cache it returns and
        return its (b, s, vocab) logits (only the last position when the model can skip the
        others, as `model.generate` does)."""
        if self._call is None:
            params = inspect.signature(model.forward).parameters
            self._call = (cache_argument(model),
                          {"logits_to_keep": 1} if "logits_to_keep" in params else {})
        argument, extra = self._call
        out = model(input_ids=ids, use_cache=True, **{argument: self.hf}, **extra)
        returned = getattr(out, argument, None)
        if returned is None:
            returned = getattr(out, "past_key_values", None)
        if returned is None:
            raise TypeError(f"{type(model).__name__} returned no cache (neither .{argument} nor "
                            ".past_key_values) with use_cache=True: generate cannot go on "
                            "without recomputing the prompt")
        self.hf = returned
        return out.logits

    def tensors(self):
        """The cached key and value tensors, layer by layer (empty before the prompt)."""
        cache = self.hf
        if cache is None:
            return []
        if hasattr(cache, "layers"):            # transformers >= 4.54: one object per layer
            pairs = [(getattr(layer, "keys", None), getattr(layer, "values", None))
                     for layer in cache.layers]
        elif hasattr(cache, "key_cache"):       # transformers 4.45-4.53: two lists
            pairs = list(zip(cache.key_cache, cache.value_cache))
        elif isinstance(cache, (tuple, list)):  # the legacy tuple of (k, v) per layer
            pairs = [tuple(layer[:2]) for layer in cache]
        else:
            raise TypeError(f"cannot read the tensors of a {type(cache).__name__}: labkit knows "
                            "DynamicCache's layers, key_cache/value_cache and (k, v) tuples")
        return [t for pair in pairs for t in pair if isinstance(t, torch.Tensor)]

    def nbytes(self):
        return sum(t.nbytes for t in self.tensors())

    @property
    def length(self):
        """Tokens cached per sequence (0 before the prompt)."""
        keys = self.tensors()
        return keys[0].shape[-2] if keys else 0
