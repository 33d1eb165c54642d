"""Synthetic, seeded data: every rank can make the same global batch and take its own shard.

Token data follows a fixed rule (each next token is an affine function of the last, mod the
vocabulary, with some noise), so a tiny GPT's loss visibly falls within a few dozen steps.
"""
import torch


def token_batch(step, batch, seq, vocab, seed=0):
    """The global batch for `step`: (inputs, targets), both (batch, seq) int64."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    positions = torch.arange(seq + 1).unsqueeze(0)
    tokens = (start + stride * positions * 7) % vocab
    noise = torch.rand(batch, seq + 1, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab, tokens.shape, generator=g), tokens)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def regression_batch(step, batch, dim_in, dim_out, seed=0):
    """The global batch for an MLP: x ~ N(0, 1), y a fixed smooth function of x."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(batch, dim_in, generator=g)
    w = torch.randn(dim_in, dim_out, generator=torch.Generator().manual_seed(seed))
    return x, torch.tanh(x @ w / dim_in ** 0.5)


def batch_for(model, step, batch, seed=0):
    """The global batch that fits `model` (a TinyGPT or an MLP)."""
    if hasattr(model, "cfg"):
        return token_batch(step, batch, model.cfg.seq, model.cfg.vocab, seed)
    return regression_batch(step, batch, model.dims[0], model.dims[-1], seed)


def shard(tensor, rank, world_size):
    """This rank's contiguous slice of dim 0; the global batch must divide evenly."""
    if tensor.shape[0] % world_size:
        raise ValueError(f"global batch of {tensor.shape[0]} does not split evenly over "
                         f"{world_size} ranks; use a multiple of {world_size}")
    size = tensor.shape[0] // world_size
    # A copy, not a view: a rank holds only its shard (and memory counts only that).
    return tensor[rank * size:(rank + 1) * size].clone()
