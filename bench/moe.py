"""labkit's ExpertParallel against expert parallelism written directly on torch.distributed.

PyTorch has no MoE layer or expert-parallel wrapper of its own, so the anchor is the obvious
plain-torch version on the same layer (labkit's MoELayer: 8 experts, top-2, capacity factor
1.25, hidden 128, expert ffn 256), the same routing conventions, the same data: the routing
counts with `dist.all_gather_single`, dispatch and combine with PyTorch's differentiable
`all_to_all_single_autograd` (torch.distributed._functional_collectives, what PyTorch now
recommends over torch.distributed.nn.functional), expert gradients divided by N with hooks.
One launch per world size; inside it every rank runs the two sides in interleaved rounds (the
order alternates, so neither side always runs on the warmer machine). Per side:
  step_time_s   the slowest rank's wall time per training step (forward, backward, router
                all_reduce, SGD step; warm-up excluded): the median per round, then the median
                over rounds and the spread (min-max); instrumentation off on the labkit side
                (`ctx.off_the_record()`: no comm log, no virtual clock), none on the torch side;
  peak_bytes    rank 0's peak during one extra step, measured on both sides by labkit's memory
                tracker (parameters, .grad, optimizer state, activations saved for backward);
  max_param_diff  labkit vs torch after the same steps from the same initial layer.
labkit_over_torch = labkit / torch (below 1: labkit is faster or smaller).
Run: python bench/moe.py [world sizes...]   (rows are appended to data/bench.csv)
"""
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from common import replace_rows, side_steps  # noqa: E402
from labkit.models import MoEConfig, MoELayer  # noqa: E402
from labkit.parallel.moe import ExpertParallel  # noqa: E402
from labkit.runtime.memory import MemoryTracker  # noqa: E402

HIDDEN, FFN, TOKENS_PER_RANK = 128, 256, 256
MOE = MoEConfig(experts=8, top_k=2, capacity_factor=1.25)
WARMUP, TIMED, ROUNDS = 2, 8, 8
SIDES = ("labkit", "torch")


class TorchExpertParallel(nn.Module):
    """The same layer's experts over the world, written the obvious way on torch.distributed."""

    def __init__(self, layer):
        super().__init__()
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.E, self.k, self.cf = layer.moe.experts, layer.moe.top_k, layer.moe.capacity_factor
        self.per = self.E // self.n
        self.router = layer.router
        self.experts = nn.ModuleDict({str(e): layer.experts[str(e)]
                                      for e in range(self.rank * self.per,
                                                     (self.rank + 1) * self.per)})
        for p in self.experts.parameters():     # an expert's grad sums every rank's tokens
            p.register_hook(lambda g: g / self.n)

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        top_p, expert = probs.topk(self.k, dim=-1)
        weight = top_p / top_p.sum(-1, keepdim=True)
        onehot = F.one_hot(expert, self.E)                        # (T, k, E)
        counts = torch.empty(self.n, self.k, self.E, dtype=torch.long)
        dist.all_gather_single(counts, onehot.sum(0)[None].contiguous())
        slots = math.ceil(self.cf * self.k * x.shape[0] * self.n / self.E)
        total = counts.sum(0)
        ahead = total.cumsum(0) - total + counts[:self.rank].sum(0)
        position = ((onehot.cumsum(0) - onehot + ahead) * onehot).sum(-1)
        tok, choice = (position < slots).nonzero(as_tuple=True)
        dest = expert[tok, choice]
        order = (dest * slots + position[tok, choice]).argsort()
        tok, choice, dest = tok[order], choice[order], dest[order]
        send = torch.bincount(dest // self.per, minlength=self.n)
        start = (total.cumsum(0) - total) + (counts.cumsum(0) - counts)     # (N, k, E)
        fits = (slots - start).clamp(min=0).minimum(counts).sum(1)           # (N, E)
        mine = fits[:, self.rank * self.per:(self.rank + 1) * self.per]      # (N, E/N)
        recv = mine.sum(1)
        rows = funcol.all_to_all_single_autograd(x[tok], recv.tolist(), send.tolist(),
                                                 dist.group.WORLD).wait()
        row_expert = torch.arange(self.rank * self.per, (self.rank + 1) * self.per)
        row_expert = row_expert.repeat(self.n).repeat_interleave(mine.flatten())
        out = rows * 0
        for name, e in self.experts.items():
            idx = (row_expert == int(name)).nonzero().squeeze(1)
            if idx.numel():
                out = out.index_copy(0, idx, e(rows[idx]))
        done = funcol.all_to_all_single_autograd(out, send.tolist(), recv.tolist(),
                                                 dist.group.WORLD).wait()
        return torch.zeros_like(x).index_add(0, tok, done * weight[tok, choice, None])


def make(side):
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, FFN, MOE)
    return ExpertParallel(layer) if side == "labkit" else TorchExpertParallel(layer)


def batch(ctx, step):
    g = torch.Generator().manual_seed(1000 * step + ctx.rank)
    x = torch.randn(TOKENS_PER_RANK, HIDDEN, generator=g, requires_grad=True)
    return x, torch.randn(TOKENS_PER_RANK, HIDDEN, generator=g)


def one_side(ctx, side):
    """Build, train WARMUP + TIMED steps (timed, bare), then one step under the tracker."""
    ctx.memory = MemoryTracker(ctx)
    layer = make(side)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, foreach=False)
    ctx.memory.watch(model=layer, optimizer=optimizer)
    router = [p for n, p in layer.named_parameters() if "experts." not in n]

    def step(i):
        x, y = batch(ctx, i)
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(layer(x), y).backward()
        for p in router:   # the same plain all_reduce on both sides: the router is replicated
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        optimizer.step()

    times = []
    for i in range(WARMUP + TIMED):
        dist.barrier()
        started = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - started)
    ctx.memory.reset_peak()
    with ctx.memory.track_activations():
        step(WARMUP + TIMED)
    ctx.memory.sample("after the measured step")
    full = layer.full_state_dict() if side == "labkit" else None
    local = {n.replace("module.", ""): p.detach().clone() for n, p in layer.named_parameters()}
    return dict(step_wall_s=times[WARMUP:], peak=ctx.memory.peak, params=local, full=full)


def rounds(ctx):
    torch.set_num_threads(1)
    out = {side: [] for side in SIDES}
    with ctx.off_the_record():
        for r in range(ROUNDS):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                out[side].append(one_side(ctx, side))
    return out


def summarise(results):
    out = side_steps(results, SIDES, ROUNDS)
    ratios = [a / b for a, b in zip(out["labkit"]["rounds"], out["torch"]["rounds"])]
    out["spread"] = (min(ratios), max(ratios))
    out["diff"] = max((r["labkit"][-1]["params"][k] - r["torch"][-1]["params"][k]).abs().max()
                      .item() for r in results for k in r["torch"][-1]["params"])
    return out


def main(world_sizes=(2, 4)):
    setting = (f"MoELayer h{HIDDEN} expert ffn {FFN}, {MOE.experts} experts top-{MOE.top_k} cf "
               f"{MOE.capacity_factor}; {TOKENS_PER_RANK} tokens per rank; SGD; gloo CPU, "
               f"{os.cpu_count()} cores; {ROUNDS} interleaved rounds x {TIMED} timed steps")
    print(setting)
    rows = []
    for n in world_sizes:
        t0 = time.time()
        s = summarise(labkit.launch(rounds, n, timeout_s=1800))
        lab, tor = s["labkit"], s["torch"]
        ratio, peak_ratio = lab["step"] / tor["step"], lab["peak"] / tor["peak"]
        a, b = s["spread"]
        print(f"\nworld size {n} ({time.time() - t0:.0f} s)")
        for side in SIDES:
            x = s[side]
            print(f"  {side:7} step {x['step'] * 1e3:7.2f} ms (rounds {min(x['rounds']) * 1e3:.2f}"
                  f" - {max(x['rounds']) * 1e3:.2f})  peak {x['peak'] / 1e6:.3f} MB")
        print(f"  labkit_over_torch: time {ratio:.2f} (per-round {a:.2f}-{b:.2f}), peak memory "
              f"{peak_ratio:.2f}; max param diff {s['diff']:.1e}")
        assert s["diff"] < 1e-6, "the two implementations disagree"
        note = (f"{setting}; per-round ratio {a:.2f}-{b:.2f}; instrumentation off; shared, "
                "loaded machine")
        base = dict(benchmark="moe", labkit_impl="ExpertParallel",
                    torch_impl="funcol all_to_all_single_autograd, written out", world_size=n)
        rows += [dict(base, metric="step_time_s_median", labkit=f"{lab['step']:.4e}",
                      torch=f"{tor['step']:.4e}", labkit_over_torch=f"{ratio:.2f}",
                      spread_min=f"{a:.2f}", spread_max=f"{b:.2f}", rounds=ROUNDS, notes=note),
                 dict(base, metric="peak_bytes_rank0", labkit=lab["peak"], torch=tor["peak"],
                      labkit_over_torch=f"{peak_ratio:.2f}",
                      notes="labkit memory tracker on both"),
                 dict(base, metric="max_param_diff", labkit=f"{s['diff']:.1e}",
                      notes=f"after {WARMUP + TIMED + 1} SGD steps")]
    replace_rows(rows)
    print(f"\n{len(rows)} rows written to data/bench.csv (a rerun replaces its configurations' "
          "rows; column labkit_over_torch)")


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (2, 4))
