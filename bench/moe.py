"""Expert parallelism: all-to-all dispatch against all-gather dispatch, and MoE against dense.

PyTorch has no MoE layer, so the anchors are built from the same pieces, in one run, on the same
tokens and world size: (1) all-gather dispatch, where every rank gathers every token of the
group, runs its own experts on the ones routed to them and reduce-scatters the outputs back
(wire bytes independent of k and of the routing, (N-1) T h each way); (2) a dense MLP model of
the same active parameters per token (TinyGPT with ffn = k x expert ffn), data-parallel. Both
MoE variants must give the same loss and parameters. Step time: median wall, warm-up excluded,
labkit clock disabled. Rows go to data/bench.csv.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_rows, median  # noqa: E402

from labkit import data, models, moe  # noqa: E402
from labkit.models import MoEConfig, MoELayer, choice_counts  # noqa: E402
from labkit.runs.reference import RunConfig, batch, build_optimizer  # noqa: E402
from labkit.runtime.launch import launch  # noqa: E402

WORLD, STEPS, WARMUP = 4, 8, 2
MODEL = dict(layers=2, hidden=64, ffn=256, seq=32, heads=4)
# router losses off: all-gather dispatch computes the aux loss on every rank for all tokens
MOE = MoEConfig(experts=4, top_k=2, capacity_factor=1.25, aux_loss_coef=0.0, z_loss_coef=0.0)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, group):
        fctx.saved = (ctx, group)
        return ctx.comm.all_gather(x, group=group)

    @staticmethod
    def backward(fctx, grad):
        ctx, group = fctx.saved
        return ctx.comm.reduce_scatter(grad.contiguous(), group=group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, ctx, group):
        fctx.saved = (ctx, group)
        return ctx.comm.reduce_scatter(x, group=group)

    @staticmethod
    def backward(fctx, grad):
        ctx, group = fctx.saved
        return ctx.comm.all_gather(grad.contiguous(), group=group), None, None


class AllGatherDispatchMoE(moe.ExpertParallelMoE):
    """Every rank sees every token: gather, route all, run my experts, reduce-scatter back."""

    def forward(self, x):
        shape, lay = x.shape, self.layout
        everyone = _AllGather.apply(x.reshape(-1, shape[-1]).contiguous(), self.ctx,
                                    lay.ep_group)
        logits, probs, expert, weight = self.gate(everyone)
        counts = choice_counts(expert, self.moe.experts)[None]
        routing = self.assign(logits, probs, expert, weight, counts, 0, everyone.shape[0])
        partial = MoELayer.apply_experts(self, everyone, routing)   # only my experts
        self.last = [routing] if lay.ep_group.rank == 0 else []
        return _ReduceScatter.apply(partial, self.ctx, lay.ep_group).view(shape)


def run(ctx, cfg, variant):
    """Train `variant` ('all_to_all', 'all_gather' or 'dense') and time its steps."""
    ctx.clock.enabled = False
    if variant == "dense":
        kw = dict(cfg.model_kwargs, ffn=MOE.top_k * MODEL["ffn"])
        model = models.build("gpt", seed=cfg.seed, **kw)
        layout = moe.Layout(ctx.world_size, 1, ctx.world, None, 1)
    else:
        model, layout = moe.expert_parallel_model(ctx, cfg, MOE)
        if variant == "all_gather":
            for block in model.blocks:
                block.mlp = AllGatherDispatchMoE(block.mlp, ctx, layout)
    optimizer = build_optimizer(model.parameters(), cfg)
    times, losses = [], []
    for step in range(cfg.steps):
        x, y = (data.shard(t, ctx.rank, ctx.world_size) for t in batch(model, cfg, step))
        ctx.comm.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        moe.sync_gradients(ctx, model, layout)
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step == WARMUP - 1:
            ctx.comm.reset()   # count bytes over the timed steps only
    params = moe.gather_params(ctx, model, layout) if variant != "dense" else None
    wire = sum(r.wire_bytes_per_rank for r in ctx.comm.records
               if r.op in ("all_to_all", "all_gather", "reduce_scatter") and
               r.tag not in ("gather params", "moe counts"))
    counts = sum(r.wire_bytes_per_rank for r in ctx.comm.records if r.tag == "moe counts")
    return dict(step_s=median(times[WARMUP:]), losses=losses, params=params,
                dispatch_wire=wire, counts_wire=counts,
                active=sum(p.numel() for n, p in model.named_parameters()
                           if not moe.is_expert(n)))


def main():
    # SGD: Adam would turn the ~1e-11 rounding noise of the exactly-zero key-bias gradient
    # into lr-sized steps, hiding whether the two dispatches agree
    cfg = RunConfig(steps=STEPS, global_batch=8, optimizer="sgd", lr=0.1, model_kwargs=MODEL)
    out = {v: launch(run, WORLD, cfg, v) for v in ("all_to_all", "all_gather", "dense")}
    a2a, ag, dense = (out[v] for v in ("all_to_all", "all_gather", "dense"))
    step = {v: max(r["step_s"] for r in out[v]) for v in out}
    loss_diff = max(abs(a - b) for a, b in zip(a2a[0]["losses"], ag[0]["losses"]))
    param_diff = max((a2a[0]["params"][k] - ag[0]["params"][k]).abs().max().item()
                     for k in a2a[0]["params"])
    wire_a2a = sum(r["dispatch_wire"] for r in a2a) / WORLD
    wire_ag = sum(r["dispatch_wire"] for r in ag) / WORLD
    timed = STEPS - WARMUP
    print(f"{WORLD} ranks, {MOE.experts} experts top-{MOE.top_k}, capacity factor "
          f"{MOE.capacity_factor}, tiny GPT {MODEL}")
    print(f"  dispatch wire bytes per rank per step: all-to-all {wire_a2a / timed:,.0f}  "
          f"all-gather {wire_ag / timed:,.0f}  ratio {wire_a2a / wire_ag:.3f} "
          f"(theory, no drops: k/N = {MOE.top_k / WORLD:.3f})")
    counts = sum(r["counts_wire"] for r in a2a) / WORLD / timed
    print(f"  (+ routing counts all-gather {counts:,.0f} B per rank per step, all-to-all only)")
    print(f"  step time (median wall, measured here): all-to-all {step['all_to_all'] * 1e3:.1f} "
          f"ms  all-gather {step['all_gather'] * 1e3:.1f} ms  dense MLP "
          f"{step['dense'] * 1e3:.1f} ms")
    print(f"  equality all-to-all vs all-gather: max loss diff {loss_diff:.1e}, "
          f"max param diff {param_diff:.1e}")
    note = (f"{MOE.experts} experts top-{MOE.top_k} cf {MOE.capacity_factor}; tiny GPT hidden "
            f"{MODEL['hidden']}; CPU gloo, 2 busy cores")
    rows = [
        dict(benchmark="moe", labkit_impl="all-to-all dispatch", torch_impl="all-gather dispatch",
             world_size=WORLD, metric="dispatch_wire_bytes_per_rank_step",
             labkit=f"{wire_a2a / timed:.0f}", torch=f"{wire_ag / timed:.0f}",
             ratio=f"{wire_a2a / wire_ag:.3f}", notes=note),
        dict(benchmark="moe", labkit_impl="all-to-all dispatch", torch_impl="all-gather dispatch",
             world_size=WORLD, metric="step_time_s", labkit=f"{step['all_to_all']:.4f}",
             torch=f"{step['all_gather']:.4f}",
             ratio=f"{step['all_to_all'] / step['all_gather']:.3f}",
             notes=f"{note}; max param diff {param_diff:.1e}"),
        dict(benchmark="moe", labkit_impl="MoE block (EP all-to-all)",
             torch_impl="dense MLP, same active params", world_size=WORLD,
             metric="step_time_s", labkit=f"{step['all_to_all']:.4f}",
             torch=f"{step['dense']:.4f}", ratio=f"{step['all_to_all'] / step['dense']:.3f}",
             notes=f"{note}; dense ffn = k x expert ffn, data-parallel"),
    ]
    assert loss_diff < 1e-5 and param_diff < 1e-5, "the two dispatches disagree"
    append_rows(rows)


if __name__ == "__main__":
    main()
