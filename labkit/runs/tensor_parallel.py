"""Tensor parallelism on labkit's tiny GPT: `parallelize_module` with a Megatron plan, against
one device.

`python -m labkit run tp --world-size 2 [--sequence-parallel] [--heads 8 --hidden 64] --json`.
The world is the TP group; every rank sees the whole batch. The loss is the vocab-parallel
cross-entropy over the head's vocabulary shards (3 all-reduces of b*s numbers instead of
gathering b*s*V logits); the report compares the gathered parameters with the single-device
run and the comm log and memory with labkit.theory.tensor_parallel.
"""
import torch

from .. import models
from ..parallel.parallel_styles import parallelize_module
from ..parallel.tensor_parallel import (gather_from_tp, gather_grads, gather_params,
                                        vocab_parallel_argmax, vocab_parallel_cross_entropy)
from ..parallel import serving
from ..parallel.tensor_parallel_plan import gpt_plan, resolve_plan
from ..theory import tensor_parallel as theory_tp
from .reference import RunConfig, batch as global_batch, build_model, build_optimizer
from .reference import gpt_config as reference_gpt_config
from .report import build_report, launch_checked, single_device
from .trainer import Trainer


def gpt_config(cfg):
    """The GPTConfig of a RunConfig (or a GPTConfig as is)."""
    return reference_gpt_config(cfg, "tensor parallelism here splits the tiny GPT's matrices "
                                     "(the MLP model has no heads to split)")


def check_tp_degree(cfg, tp, sequence_parallel=False, async_tp=False):
    """The block's one-line ValueError naming what `tp` fails to divide (heads, features,
    vocabulary, sequence with SP), on a model with no storage, before any rank starts."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"the TP degree must be a positive integer, got {tp!r}")
    if async_tp and not sequence_parallel:
        raise ValueError("--async-tp overlaps sequence parallelism's all-gather and "
                         "reduce-scatter: add --sequence-parallel")
    with torch.device("meta"):
        resolve_plan(models.TinyGPT(gpt_config(cfg)), gpt_plan(sequence_parallel), tp)


def tp_parallelize(group=None, sequence_parallel=False, regather=True, async_tp=False):
    """The technique as a function of the model (torchtitan's `parallelize_fn`): split by
    `gpt_plan` over `group`; the head keeps its logits split by vocabulary (for `gpt_loss`
    and generation)."""
    return lambda model: parallelize_module(model, group, gpt_plan(sequence_parallel),
                                            sequence_parallel=sequence_parallel,
                                            regather=regather, gather_output=False,
                                            async_tp=async_tp)


def build_tp_model(cfg, group=None, sequence_parallel=False, regather=True, async_tp=False):
    """The reference's GPT (same seed), split by `tp_parallelize`."""
    return tp_parallelize(group, sequence_parallel, regather, async_tp)(build_model(cfg))


def gpt_loss(model, x, y):
    """TinyGPT's cross-entropy, computed on the vocabulary shards of the logits."""
    logits = model(x)
    return vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                        model.head.group)


def train(ctx, cfg, sequence_parallel=False, regather=True, details=False, async_tp=False):
    """Train the TP tiny GPT on the TP group ctx.world; every rank sees the whole batch."""
    check_tp_degree(cfg, ctx.world_size, sequence_parallel)
    extra = {}

    def last_step_details():   # gradients and logits of the last step, gathered off the record
        if details and trainer.step_index == cfg.steps - 1:
            x, _ = global_batch(trainer.model, cfg, trainer.step_index)
            with ctx.off_the_record(), torch.no_grad():
                extra.update(grads=gather_grads(trainer.module),
                             logits=gather_from_tp(trainer.module(x), trainer.module.head.group))
    model = build_model(cfg)
    trainer = Trainer(ctx, cfg, model, tp_parallelize(None, sequence_parallel, regather, async_tp),
                      optimizer=build_optimizer, batch=lambda step: global_batch(model, cfg, step),
                      loss=gpt_loss, fused=True, after_backward=last_step_details)
    trainer.fit()
    comm_by_tag = ctx.comm.summary(by=("op", "tag"))
    with ctx.off_the_record():
        params = gather_params(trainer.module)
    if ctx.rank != 0:
        params, extra = None, {}
    return trainer.result(params, comm_by_tag=comm_by_tag, **extra)


def add_arguments(parser):
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="shard LayerNorm regions along the sequence (Korthikanti 2022)")
    parser.add_argument("--async-tp", action="store_true",
                        help="with --sequence-parallel: the all-gather / reduce-scatter as p2p "
                             "rings under the chunk matmuls (parallel/async_tp.py)")


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", sequence_parallel=False,
           regather=True, details=False, async_tp=False, **_):
    """Run TP (world_size = TP degree) on the tiny GPT and return the run report."""
    cfg = cfg or RunConfig()
    results = launch_checked(
        "tp", train, world_size, cfg,
        dict(sequence_parallel=sequence_parallel, regather=regather, details=details,
             async_tp=async_tp),
        check=lambda: check_tp_degree(cfg, world_size, sequence_parallel, async_tp),
        cluster=cluster)
    c = gpt_config(cfg)
    layout = dict(batch=cfg.global_batch, tp=world_size, sequence_parallel=sequence_parallel,
                  regather=regather)
    comm = theory_tp.tiny_gpt_run_comm(steps=cfg.steps, layers=c.layers, seq=c.seq,
                                       hidden=c.hidden, vocab=c.vocab, **layout)
    first = results[0]
    return build_report(
        "tp", cfg, results, **single_device(cfg),
        config=dict(tp=world_size, sequence_parallel=sequence_parallel, regather=regather,
                    async_tp=async_tp, plan=gpt_plan(sequence_parallel)),
        predicted_memory=theory_tp.tiny_gpt_training_memory(**c.as_dict(), **layout,
                                                            optimizer=cfg.optimizer),
        predicted_comm_bytes_per_rank=sum(r["wire_bytes_per_rank"] for r in comm.values()),
        predicted_comm=comm, comm_by_tag=first["comm_by_tag"],
        logits=first.get("logits"), grads=first.get("grads"))


# ------------------------------------------------------------------------------- inference

def generate(ctx, model, prompt, new_tokens):
    """Greedy decoding through the model's own KV-cache path (`serving.generate`): each rank
    caches the keys/values of its own heads, and the next token is the argmax over the
    vocabulary shards (`vocab_parallel_argmax`: 2 numbers per row, not V/t logits).
    Returns (prompt + new tokens, this rank's cache bytes). `model`: from build_tp_model
    without sequence parallelism."""
    if model.head.sequence_parallel:
        raise ValueError("generate runs without sequence parallelism: build the model with "
                         "sequence_parallel=False (one new token has no sequence to split)")
    if prompt.shape[1] + new_tokens > model.cfg.seq:
        raise ValueError(f"prompt + new tokens must fit the {model.cfg.seq} positions")
    cache = serving.KVCache()
    new = serving.generate(model, prompt, new_tokens, cache,
                           pick=lambda logits: vocab_parallel_argmax(logits, model.head.group))
    return torch.cat([prompt, new], dim=1), cache.nbytes()


def reference_generate(model, prompt, new_tokens):
    """The single-device TinyGPT, greedy, recomputing the whole prefix each token (no cache)."""
    return torch.cat([prompt, serving.generate_without_cache(model, prompt, new_tokens)], dim=1)
