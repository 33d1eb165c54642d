"""Context parallelism on labkit's tiny GPT: the sequence split across ranks, attention by ring,
all-gather or Ulysses' all-to-all over heads.

`python -m labkit run cp --world-size 4 --layout zigzag [--no-causal]
[--method all_gather|ulysses] --json`. The world is the CP group: every rank sees the whole
batch but only its shard of each sequence (`shard_sequence`, global positions for the position
embedding); each block's attention is wrapped in `ContextParallel` (Ulysses: N <= heads, refused
before ranks start); the replicated weights' gradients are averaged with one all-reduce per
step. The parameters are compared with the single-device run. Then an attention check: one
forward and backward of the method's attention on random q, k, v (causal or not, as asked),
its output and q, k, v gradients against single-device fp64 attention, the FLOPs each rank's
clock counted (contiguous causal: the last rank ~2x the mean; zigzag: balanced), its comm
bytes and saved activation bytes against labkit.theory.context_parallel.
"""
import argparse

import torch
import torch.nn.functional as F

from .. import numerics
from ..parallel.context_parallel import (CORES, LAYOUTS, ContextParallel, check_sequence,
                                         check_ulysses_heads, sequence_positions, shard_sequence)
from ..parallel.flat import average_gradients, unwrapped_name
from ..runtime.memory import MemoryTracker
from ..theory import context_parallel as theory_cp
from .reference import RunConfig, batch as global_batch, build_model, build_optimizer
from .reference import gpt_config as reference_gpt_config, token_loss
from .reference import float64_reference, train as reference_train

ATTENTION_TAGS = ("ring attention", "all-gather attention", "ulysses attention")
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


def build_cp_model(cfg, group=None, layout="zigzag", method="ring"):
    """The reference's GPT (same seed) with every block's attention wrapped in ContextParallel."""
    model = build_model(cfg)
    for block in model.blocks:
        block.attn = ContextParallel(block.attn, group, layout, method)
    return model


def train(ctx, cfg, layout="zigzag", method="ring", causal=True, check_shape=None):
    """Train the CP tiny GPT on ctx.world (the CP group), then run the attention check."""
    from .report import rank_result
    c = gpt_config(cfg)
    check_cp(cfg, ctx.world_size, layout, method)
    model = build_cp_model(cfg, None, layout, method)
    optimizer = build_optimizer(model.parameters(), cfg)
    ctx.memory.watch(model=model, optimizer=optimizer)
    positions = sequence_positions(c.seq, ctx.rank, ctx.world_size, layout)
    losses = []
    for step in range(cfg.steps):
        with ctx.step(step, cfg.steps):
            x, y = global_batch(model, cfg, step)
            x, y = shard_sequence(x, None, layout), shard_sequence(y, None, layout)
            optimizer.zero_grad(set_to_none=True)
            with ctx.memory.track_activations(), ctx.clock.compute("forward+backward"):
                logits = model(x, positions=positions)
                loss = token_loss(logits, y)
                loss.backward()
            # replicated weights, each rank's loss the mean over its tokens: average
            average_gradients(model.parameters(), tag="cp gradient all-reduce")
            with ctx.clock.compute("optimizer step"):
                optimizer.step()
        with ctx.off_the_record():   # the whole sequence's loss: the mean of the shards'
            losses.append(ctx.comm.all_reduce(loss.detach().clone(), op="avg").item())
    comm = ctx.comm.summary()
    params = {unwrapped_name(n): p.detach().clone() for n, p in model.named_parameters()}
    shape = check_shape or (2, c.heads, c.seq, c.hidden // c.heads)
    check = attention_check(ctx, shape, causal, layout, method)
    return rank_result(ctx, losses, params=params if ctx.rank == 0 else None, comm=comm,
                       attention_check=check)


def attention_check(ctx, shape, causal, layout, method, seed=0):
    """One CP attention forward + backward on random (b, h, s, d) inputs against fp64
    single-device attention, judged by fp32 single-device attention's own error
    (labkit.numerics); this rank's counted FLOPs, comm bytes, saved bytes, timeline."""
    b, h, s, d = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, s, d, generator=g) for _ in range(4))
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=causal)
    expected.backward(do.double())
    single = [t.clone().requires_grad_() for t in (q, k, v)]
    one_device = F.scaled_dot_product_attention(*single, is_causal=causal)
    one_device.backward(do)
    mine = [shard_sequence(t, None, layout, dim=2).requires_grad_() for t in (q, k, v)]
    ctx.comm.barrier(tag="attention check")        # start together on the modelled clock
    ctx.comm.reset()
    first_event, flops, start = len(ctx.clock.events), ctx.clock.flops, ctx.clock.t
    tracker = MemoryTracker()
    with tracker.track_activations():
        out = CORES[method](*mine, None, causal, layout)
    out.backward(shard_sequence(do, None, layout, dim=2))
    names = ("out", "dq", "dk", "dv")
    mine_rows, exact_rows, single_rows = (
        {n: shard_sequence(t.detach(), None, layout, dim=2) if rows else t.detach()
         for n, t in zip(names, ts)}
        for ts, rows in (([out] + [m.grad for m in mine], False),
                         ([expected] + [f.grad for f in full], True),
                         ([one_device] + [t.grad for t in single], True)))
    diffs = {n: (mine_rows[n].double() - exact_rows[n]).abs().max().item() for n in names}
    agreement = numerics.compare(mine_rows, single_rows, exact_rows)
    wire = sum(r["wire_bytes_per_rank"] for r in ctx.comm.summary(by=("op", "tag"))
               if r["tag"].startswith(ATTENTION_TAGS))
    timeline = [dict(e, start=e["start"] - start, end=e["end"] - start)
                for e in ctx.clock.timeline()[first_event:]]
    return dict(max_diff=diffs, agreement=agreement, flops=ctx.clock.flops - flops,
                wire_bytes=wire,
                saved_bytes=tracker.max_saved_bytes, modelled_s=ctx.clock.t - start,
                timeline=timeline)


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
    from .report import build_report, launch_checked
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
    flops = [ch["flops"] for ch in checks]
    attention = dict(
        shape=dict(batch=b, heads=h, seq=s, head_dim=d), causal=causal, method=method,
        max_diff={k: max(ch["max_diff"][k] for ch in checks) for k in checks[0]["max_diff"]},
        within_rounding=all(ch["agreement"].ok for ch in checks),
        verdict=str(max((ch["agreement"] for ch in checks), key=lambda a: a.error / a.limit)),
        flops_per_rank=flops, imbalance=theory_cp.imbalance(flops) if sum(flops) else None,
        comm_bytes_per_rank=[ch["wire_bytes"] for ch in checks],
        saved_bytes_per_rank=[ch["saved_bytes"] for ch in checks],
        modelled_s=max(ch["modelled_s"] for ch in checks),
        **theory_cp.attention_call_prediction(b, h, s, d, world_size, layout, causal, method))
    out = build_report(
        "cp", cfg, results, reference=reference_train(cfg), exact=float64_reference(cfg),
        config=dict(cp=world_size, layout=layout, method=method, causal=causal),
        predicted_memory=theory_cp.tiny_gpt_memory_per_rank(c.param_count(), cfg.optimizer),
        predicted_comm_bytes_per_rank=theory_cp.tiny_gpt_comm_bytes_per_rank(
            layers=c.layers, batch=cfg.global_batch, heads=c.heads, seq=c.seq,
            head_dim=c.hidden // c.heads, params=c.param_count(), cp=world_size,
            steps=cfg.steps, method=method),
        attention_check=attention)
    out["attention_timeline"] = [e for ch in checks for e in ch["timeline"]]
    return out
