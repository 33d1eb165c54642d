"""The single-device reference run that every parallel technique is checked against.

One process, the full global batch, plain `loss.backward(); optimizer.step()`. A technique run
on N ranks must end with the same loss curve and the same parameters within float32 rounding:
within a few times this run's own distance to the same run in float64 (`float64_reference`,
labkit.numerics).
Memory on one device, for mixed-precision-free fp32 Adam: 4Ψ weights + 4Ψ grads + 8Ψ moments.
"""
from dataclasses import dataclass, field, asdict

import torch
import torch.nn.functional as F

from .. import data, models
from ..theory.memory import fp32_rank_bytes, tiny_gpt_activation_bytes
from ..theory.rank_memory import mlp_activation_bytes
from .trainer import Trainer


@dataclass
class RunConfig:
    """What every technique trains: model, steps, global batch, optimizer and seed."""
    model: str = "gpt"
    steps: int = 3
    global_batch: int = 8
    lr: float = 1e-2
    optimizer: str = "adam"
    seed: int = 0
    model_kwargs: dict = field(default_factory=dict)

    def as_dict(self):
        return asdict(self)


def build_model(cfg):
    return models.build(cfg.model, seed=cfg.seed, **cfg.model_kwargs)


def gpt_config(cfg, needs="this technique needs the tiny GPT"):
    """The GPTConfig of a RunConfig (a GPTConfig as is); a one-line error for the MLP."""
    if isinstance(cfg, models.GPTConfig):
        return cfg
    if cfg.model != "gpt":
        raise ValueError(f"{needs}: use --model gpt")
    return models.GPTConfig(**cfg.model_kwargs)


def token_loss(logits, target):
    """The GPT's loss on its output: cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def loss_fn(cfg):
    """The model's own loss as loss_fn(output, target), for a block that computes the loss
    itself (a pipeline's last stage): the GPT's cross-entropy, the MLP's mean squared error."""
    return token_loss if cfg.model in ("gpt", "moe") else F.mse_loss


def optimizer_spec(cfg):
    """(class, options) of the run's optimizer, for blocks that build their own (ZeRO's
    ShardedOptimizer, the hybrid): Adam or plain SGD, as `build_optimizer` makes it."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam, dict(lr=cfg.lr, eps=1e-6, foreach=False)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD, dict(lr=cfg.lr, foreach=False)
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {cfg.optimizer!r}")


def build_optimizer(params, cfg):
    """Adam or plain SGD; `foreach=False` keeps the update order identical across layouts.

    Adam's eps is 1e-6, not 1e-8: the attention key bias has a true gradient of exactly zero
    (softmax ignores a constant shift of a row of scores), so what backward computes for it is
    float rounding noise (~1e-10), which differs between layouts. Adam's step is then
    lr * noise / (|noise| + eps): with eps 1e-8 that is ~lr/100 and more, far above rounding;
    with eps 1e-6 it stays ~lr * 1e-4. Runs are still judged against a float64 reference
    (labkit.numerics), whose float32 twin makes the same kind of noise.
    """
    optimizer_class, options = optimizer_spec(cfg)
    return optimizer_class(params, **options)


def batch(model, cfg, step, dtype=None):
    """The global batch of `step`: the same tensors on every rank and in the reference
    (floating ones cast to `dtype` if given: the float64 reference)."""
    x, y = data.batch_for(model, step, cfg.global_batch, cfg.seed)
    if dtype is None:
        return x, y
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in (x, y))


def train(cfg=None, ctx=None, track_memory=True, dtype=torch.float32, model=None,
          step_stats=None):
    """Train on one device; returns losses, final parameters and measured memory.

    With a `ctx` (a one-rank launch) the step is also placed on the modelled clock.
    `dtype=torch.float64`: the same run in float64, the "exact" answer that float32 runs are
    judged against (labkit.numerics). `model`: a model to train instead of the one `cfg`
    builds (MoE's, with its routing groups); `step_stats(model)`: what to record after each
    step, returned as "step_stats".
    """
    cfg = cfg or RunConfig()
    model = (model if model is not None else build_model(cfg)).to(dtype)
    stats = []
    trainer = Trainer(ctx, cfg, model, optimizer=build_optimizer, batch=batch, fused=True,
                      track_activations=track_memory, dtype=dtype, progress=False,
                      after_step=None if step_stats is None
                      else lambda step: stats.append(step_stats(model))).fit()
    return dict(loss=trainer.losses, params=full_params(model), memory=trainer.memory.report(),
                param_count=sum(p.numel() for p in model.parameters()), step_stats=stats)


def train_mixed_precision(cfg=None, compute_dtype=torch.bfloat16):
    """One device, full batch, the mixed-precision algorithm: a `compute_dtype` copy of the
    weights computes forward and backward; the optimizer steps fp32 masters that start from the
    unrounded fp32 weights; the low-precision copy is refreshed from them before each forward."""
    cfg = cfg or RunConfig()
    master = build_model(cfg)
    work = build_model(cfg).to(compute_dtype)
    optimizer = build_optimizer(master.parameters(), cfg)
    pairs = list(zip(master.parameters(), work.parameters()))
    losses = []
    for step in range(cfg.steps):
        x, y = batch(master, cfg, step, compute_dtype)
        with torch.no_grad():
            for m, w in pairs:
                w.copy_(m)
                w.grad = None
        loss = work(x, y)
        loss.backward()
        for m, w in pairs:
            m.grad = None if w.grad is None else w.grad.float()
        optimizer.step()
        losses.append(loss.item())
    return dict(loss=losses, params=full_params(master))


def full_params(model):
    """Name -> a detached copy of every parameter (what `max_param_diff` compares)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def float64_reference(cfg):
    """The reference run in float64 (losses and parameters, no memory tracking)."""
    return train(cfg, track_memory=False, dtype=torch.float64)


def max_param_diff(params, reference):
    """Largest absolute difference between two {name: tensor} dicts with the same names."""
    missing = set(reference) ^ set(params)
    if missing:
        raise KeyError(f"parameter names differ: {sorted(missing)[:5]}")
    return max((params[k] - reference[k]).abs().max().item() for k in reference)


def predict_memory(cfg, model=None, batch_size=None, **extra):
    """theory/'s bytes for one replica of `model` (default: the model `cfg` builds): fp32 states
    (4+4+8)Ψ for Adam, the activations of `batch_size` examples (default: the global batch),
    and any `extra` named bytes (a technique's buffers).

    `peak` is params + grads + optimizer + activations: an upper bound, since backward frees
    activations while it fills in gradients.
    """
    model = model or build_model(cfg)
    batch_size = cfg.global_batch if batch_size is None else batch_size
    return fp32_rank_bytes(sum(p.numel() for p in model.parameters()),
                           activation_bytes(model, batch_size), cfg.optimizer, **extra)


def activation_bytes(model, batch_size):
    """What `model` saves for backward on a batch of `batch_size` (theory/ formulas)."""
    if isinstance(model, models.TinyGPT):
        c = model.cfg
        return tiny_gpt_activation_bytes(layers=c.layers, seq=c.seq, batch=batch_size,
                                         hidden=c.hidden, heads=c.heads, vocab=c.vocab)
    return mlp_activation_bytes(model.dims, batch_size)
