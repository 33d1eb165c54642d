"""The KV cache of generation: each attention layer's keys and values so far, so that a decode
step computes only the new token's q, k, v (Pope et al. 2022, arXiv 2211.05102).

Shared: `serving.generate` and `PipelineGenerator` fill it, labkit's `models.Attention` and the
Hugging Face pipeline adapter (hf_stages.py, which decodes through it to check its cut) read
and append to it. It holds no technique: a dict of tensors per layer, and their bytes.
"""
import torch


class KVCache:
    """The keys and values every attention layer has computed so far, so that generating one
    more token computes only that token's q, k, v (Pope et al. 2022, arXiv 2211.05102).

    Keyed by the attention module itself: a pipeline stage's cache holds its own layers only,
    and a tensor-parallel rank's holds its own heads (its k, v are narrower), so the cache is
    sharded the way the weights are. Bytes: 2 x layers x batch x tokens x kv width x dtype.
    """

    def __init__(self):
        self.keys, self.values = {}, {}
        self.positions_seen = 0     # the embedding's count: a stage may hold no attention

    def claim_positions(self, count):
        """The first position of the next `count` tokens (the embedding asks, once a forward)."""
        start, self.positions_seen = self.positions_seen, self.positions_seen + count
        return start

    def update(self, layer, k, v):
        """Append this step's (b, s, width) k and v for `layer`; return all of them."""
        key = id(layer)
        if key in self.keys:
            k = torch.cat([self.keys[key], k], dim=1)
            v = torch.cat([self.values[key], v], dim=1)
        self.keys[key], self.values[key] = k, v
        return k, v

    @property
    def length(self):
        """Tokens cached per sequence (0 before the prompt)."""
        return next(iter(self.keys.values())).shape[1] if self.keys else self.positions_seen

    def nbytes(self):
        return sum(t.nbytes for t in (*self.keys.values(), *self.values.values()))
