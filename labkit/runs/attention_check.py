"""One distributed attention call checked against one device: the values, the work, the bytes.

`attention_check` runs one forward and backward of a context-parallel attention core (ring,
all-gather or Ulysses, from parallel/context_parallelism's `CORES`) on random (b, h, s, d) q, k,
v, with this rank holding its shard of the sequence (`shard_sequence`), and compares its output
and q, k, v gradients with single-device fp64 attention, judged by fp32 single-device
attention's own error (labkit.numerics). It also returns what this rank's instruments counted
for that one call: the FLOPs on the clock (contiguous causal: the last rank ~2x the mean;
zigzag: balanced), the wire bytes of the attention's collectives, the activation bytes saved
for backward and the modelled seconds with their timeline, for comparison with
labkit.theory.context_parallel. It is a run, not a block: it drives a block's cores under the
rank's instruments, so it lives in runs/ beside the CP driver that reports it.
`merge_attention_checks` folds every rank's check into one measured summary.
"""
import torch
import torch.nn.functional as F

from .. import numerics
from ..runtime.memory import MemoryTracker
from ..parallel.context_parallelism import CORES, shard_sequence

ATTENTION_TAGS = {"ring": "ring attention", "all_gather": "all-gather attention",
                  "ulysses": "ulysses attention"}   # the cores' comm tags and clock regions
NAMES = ("out", "dq", "dk", "dv")


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
    # one region for the backward: all-gather's and Ulysses' run in autograd, the ring's opens
    # its own per block (nested, counted here under the same name)
    with ctx.clock.compute(f"{ATTENTION_TAGS[method]} backward"):
        out.backward(shard_sequence(do, None, layout, dim=2))
    mine_rows, exact_rows, single_rows = (
        {n: shard_sequence(t.detach(), None, layout, dim=2) if rows else t.detach()
         for n, t in zip(NAMES, ts)}
        for ts, rows in (([out] + [m.grad for m in mine], False),
                         ([expected] + [f.grad for f in full], True),
                         ([one_device] + [t.grad for t in single], True)))
    diffs = {n: (mine_rows[n].double() - exact_rows[n]).abs().max().item() for n in NAMES}
    agreement = numerics.compare(mine_rows, single_rows, exact_rows)
    wire = sum(r["wire_bytes_per_rank"] for r in ctx.comm.summary(by=("op", "tag"))
               if r["tag"].startswith(tuple(ATTENTION_TAGS.values())))
    timeline = [dict(e, start=e["start"] - start, end=e["end"] - start)
                for e in ctx.clock.timeline()[first_event:]]
    return dict(max_diff=diffs, agreement=agreement, flops=ctx.clock.flops - flops,
                wire_bytes=wire,
                saved_bytes=tracker.max_saved_bytes, modelled_s=ctx.clock.t - start,
                timeline=timeline)


def merge_attention_checks(checks):
    """Every rank's `attention_check` as one measured summary: the worst difference per
    tensor, one verdict (the rank closest to its limit), and the per-rank counts."""
    return dict(
        max_diff={k: max(ch["max_diff"][k] for ch in checks) for k in checks[0]["max_diff"]},
        within_rounding=all(ch["agreement"].ok for ch in checks),
        verdict=str(max((ch["agreement"] for ch in checks), key=lambda a: a.error / a.limit)),
        flops_per_rank=[ch["flops"] for ch in checks],
        comm_bytes_per_rank=[ch["wire_bytes"] for ch in checks],
        saved_bytes_per_rank=[ch["saved_bytes"] for ch in checks],
        modelled_s=max(ch["modelled_s"] for ch in checks))
