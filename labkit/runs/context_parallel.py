"""Context parallelism on labkit's tiny GPT: the sequence split across ranks, attention by ring,
all-gather or Ulysses' all-to-all over heads.

`python -m labkit run cp --world-size 4 --layout zigzag [--no-causal]
[--method all_gather|ulysses] --json`. The world is the CP group: every rank sees the whole
batch but only its shard of each sequence (`shard_sequence`, global positions for the position
embedding); each block's attention is wrapped in `ContextParallel` (Ulysses: N <= heads, refused
before ranks start); the replicated weights' gradients are averaged with one all-reduce per
step. The parameters are compared with the single-device run. Then an attention check
(runs/attention_check.py): one forward and backward of the method's attention on
random q, k, v (causal or not, as asked), its output and q, k, v gradients against
single-device fp64 attention, the FLOPs each rank's clock counted (contiguous causal: the last
rank ~2x the mean; zigzag: balanced), its comm bytes and saved activation bytes against
labkit.theory.context_parallel.
"""
import argparse

from ..parallel.context_parallelism import (CORES, LAYOUTS, ContextParallel, check_sequence,
                                         check_ulysses_heads, sequence_positions, shard_sequence)
from ..parallel.flat import average_gradients, unwrapped_name
from ..theory import context_parallel as theory_cp
from .attention_check import attention_check, merge_attention_checks
from .reference import RunConfig, batch as global_batch, build_model, build_optimizer
from .reference import gpt_config as reference_gpt_config, token_loss
from .report import build_report, launch_checked, single_device
from .trainer import Trainer

METHODS = tuple(CORES)        # ring, all_gather, ulysses


def gpt_config(cfg):
    return reference_gpt_config(cfg, "context parallelism splits the GPT's sequences (the MLP "
                                     "model has no sequence)")


def check_cp(cfg, cp, layout="zigzag", method="ring", heads=None):
    """One-line ValueError before any rank starts (`heads`: the attention check's, if not the
    model's; Ulysses needs both to split over the ranks)."""
    if layout not in LAYOUTS:
        raise ValueError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"the CP degree must be a positive integer, got {cp!r}")
    c = gpt_config(cfg)
    check_sequence(c.seq, cp, layout)
    if method == "ulysses":            # the tiny GPT's K, V have as many heads as its queries
        for h in {c.heads, heads or c.heads}:
            check_ulysses_heads(h, h, cp)


def cp_parallelize(group=None, layout="zigzag", method="ring"):
    """The technique as a function of the model (torchtitan's `parallelize_fn`): every block's
    attention wrapped in ContextParallel."""
    def apply(model):
        for block in model.blocks:
            block.attn = ContextParallel(block.attn, group, layout, method)
        return model
    return apply


def train(ctx, cfg, layout="zigzag", method="ring", causal=True, check_shape=None):
    """Train the CP tiny GPT on ctx.world (the CP group), then run the attention check."""
    c = gpt_config(cfg)
    check_cp(cfg, ctx.world_size, layout, method)
    positions = sequence_positions(c.seq, ctx.rank, ctx.world_size, layout)

    def whole_sequence_loss(loss):   # the mean of the shards' losses, off the record
        with ctx.off_the_record():
            return ctx.comm.all_reduce(loss.detach().clone(), op="avg").item()
    model = build_model(cfg)
    trainer = Trainer(
        ctx, cfg, model, cp_parallelize(None, layout, method), optimizer=build_optimizer,
        batch=lambda step: tuple(shard_sequence(t, None, layout)
                                 for t in global_batch(model, cfg, step)),
        fused=True, reduce_loss=whole_sequence_loss,
        loss=lambda model, x, y: token_loss(model(x, positions=positions), y),
        # replicated weights, each rank's loss the mean over its tokens: average
        after_backward=lambda: average_gradients(trainer.module.parameters(),
                                                 tag="cp gradient all-reduce"))
    trainer.fit()
    comm = ctx.comm.summary()
    params = {unwrapped_name(n): p.detach().clone() for n, p in trainer.module.named_parameters()}
    shape = check_shape or (2, c.heads, c.seq, c.hidden // c.heads)
    check = attention_check(ctx, shape, causal, layout, method)
    return trainer.result(params if ctx.rank == 0 else None, comm=comm, attention_check=check)


def add_arguments(parser):
    parser.add_argument("--layout", choices=LAYOUTS, default="zigzag",
                        help="which positions each rank holds (zigzag balances causal work)")
    parser.add_argument("--method", choices=METHODS, default="ring",
                        help="ring: K, V passed around a ring; all_gather: Llama 3's way; "
                        "ulysses: all-to-all over heads (N <= heads)")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction,
                        default=True, help="causal mask in the attention check")


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", layout="zigzag", method="ring",
           causal=True, check_shape=None, **_):
    """Run CP (world_size = CP degree) on the tiny GPT and return the run report."""
    cfg = cfg or RunConfig()
    c = gpt_config(cfg)
    shape = tuple(check_shape or (2, c.heads, c.seq, c.hidden // c.heads))

    def check():
        check_cp(cfg, world_size, layout, method, heads=shape[1])
        check_sequence(shape[2], world_size, layout)
    results = launch_checked(
        "cp", train, world_size, cfg,
        dict(layout=layout, method=method, causal=causal, check_shape=shape), check=check,
        cluster=cluster, timeout_s=600)
    checks = [r["attention_check"] for r in results]
    b, h, s, d = shape
    measured = merge_attention_checks(checks)
    flops = measured["flops_per_rank"]
    attention = dict(
        shape=dict(batch=b, heads=h, seq=s, head_dim=d), causal=causal, method=method,
        **measured, imbalance=theory_cp.imbalance(flops) if sum(flops) else None,
        **theory_cp.attention_call_prediction(b, h, s, d, world_size, layout, causal, method))
    out = build_report(
        "cp", cfg, results, **single_device(cfg),
        config=dict(cp=world_size, layout=layout, method=method, causal=causal),
        predicted_memory=theory_cp.tiny_gpt_memory_per_rank(c.param_count(), cfg.optimizer),
        predicted_comm_bytes_per_rank=theory_cp.tiny_gpt_comm_bytes_per_rank(
            layers=c.layers, batch=cfg.global_batch, heads=c.heads, seq=c.seq,
            head_dim=c.hidden // c.heads, params=c.param_count(), cp=world_size,
            steps=cfg.steps, method=method),
        attention_check=attention)
    out["attention_timeline"] = [e for ch in checks for e in ch["timeline"]]
    return out
