"""labkit's ZeRO against PyTorch's own, in one run on the same ranks, model and data.

stage 1 vs torch.distributed.optim.ZeroRedundancyOptimizer (under DDP), stage 3 vs
torch.distributed.fsdp.fully_shard (FSDP2: each block, then the whole model). For each pair:
median step wall time (warm-up excluded, labkit's clock off), peak memory per rank and the
largest difference of the resulting parameters.

Peak memory is measured the same way for both: glibc's bytes in use (mallinfo2: arena chunks +
mmapped blocks), polled by a thread and at every step boundary, minus the bytes in use before
the model was built. It sees everything either implementation allocates (weights, grads,
optimizer state, activations, communication buffers), which labkit's own tracker cannot do for
PyTorch's internals. Results go to data/bench.csv.
"""
import ctypes
import gc
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from common import append_rows, median  # noqa: E402
from labkit import data, zero  # noqa: E402
from labkit.runs import reference  # noqa: E402

WORLD_SIZE = 2
STEPS, WARMUP = 8, 2
CFG = reference.RunConfig(steps=STEPS, global_batch=8, model_kwargs=dict(
    vocab=256, seq=64, hidden=128, heads=4, layers=4, ffn=512))


_LIBC = {}   # loaded in each rank (ctypes handles do not pickle into the launched ranks)


def heap_in_use():
    """glibc's bytes in use: chunks handed out from the arenas plus mmapped blocks."""
    if not _LIBC:
        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        _LIBC["libc"] = libc
    info = _LIBC["libc"].mallinfo2()
    return info.uordblks + info.hblkhd


class HeapPeak:
    """The most heap bytes in use above a baseline, from `start()` to `stop()`."""

    def __init__(self, interval_s=2e-4):
        self.interval_s, self.peak, self.running = interval_s, 0, False

    def start(self):
        gc.collect()
        self.base = heap_in_use()
        self.peak, self.running = self.base, True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while self.running:
            self.sample()
            time.sleep(self.interval_s)

    def sample(self):
        self.peak = max(self.peak, heap_in_use())

    def stop(self):
        self.sample()
        self.running = False
        self.thread.join()
        return self.peak - self.base


def my_batch(model, cfg, step, ctx):
    x, y = reference.batch(model, cfg, step)
    return data.shard(x, ctx.rank, ctx.world_size), data.shard(y, ctx.rank, ctx.world_size)


def run_labkit(ctx, stage, cfg):
    ctx.clock.enabled = False   # timing: no modelled clock
    heap, marks = HeapPeak(), []

    def on_step(step):
        marks.append(time.perf_counter())
        heap.sample()
        if step == cfg.steps - 1:
            marks.append(heap.stop())

    dist.barrier()
    heap.start()
    marks.append(time.perf_counter())
    out = zero.train(ctx, cfg, stage=stage, step_callback=on_step)
    times = [b - a for a, b in zip(marks[:-2], marks[1:-1])]
    return dict(step_s=times, peak=marks[-1], params=out.get("params"))


def run_torch(ctx, kind, cfg):
    from torch.nn.parallel import DistributedDataParallel as DDP
    heap, times = HeapPeak(), []
    dist.barrier()
    heap.start()
    model = reference.build_model(cfg)
    if kind == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        module = DDP(model)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=cfg.lr,
                                            eps=1e-6, foreach=False)  # as build_optimizer
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        module = fully_shard(model, mesh=mesh)
        optimizer = reference.build_optimizer(model.parameters(), cfg)
    for step in range(cfg.steps):
        start = time.perf_counter()
        x, y = my_batch(model, cfg, step, ctx)
        loss = module(x, y)
        loss.backward()
        optimizer.step()
        # not optimizer.zero_grad: ZeroRedundancyOptimizer's clears only the parameters this
        # rank owns, and DDP would keep adding into the others' .grad
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        heap.sample()
    peak = heap.stop()
    del optimizer, module
    params = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name] = full.detach().clone()
    return dict(step_s=times, peak=peak, params=params if ctx.rank == 0 else None)


RUNS = (("labkit stage 1", run_labkit, 1), ("ZeroRedundancyOptimizer", run_torch, "zero1"),
        ("labkit stage 3", run_labkit, 3), ("FSDP2 fully_shard", run_torch, "fsdp2"))


def compare(ctx):
    # A first short pass of each: imports and one-off library set-up (tens of MB of heap)
    # would otherwise land on whichever implementation runs first.
    warm_up = reference.RunConfig(**dict(CFG.as_dict(), steps=1))
    for _, fn, arg in RUNS:
        fn(ctx, arg, warm_up)
        gc.collect()
    out = {}
    for label, fn, arg in RUNS:
        gc.collect()
        dist.barrier()
        out[label] = fn(ctx, arg, CFG)
    return out


def main():
    ranks = labkit.launch(compare, WORLD_SIZE, timeout_s=600)
    ref = reference.train(CFG, track_memory=False)
    psi = sum(p.numel() for p in reference.build_model(CFG).parameters())
    rows = []
    print(f"tiny GPT {CFG.model_kwargs}, {psi:,} params, Adam fp32, {WORLD_SIZE} ranks gloo/CPU, "
          f"{STEPS} steps ({WARMUP} warm-up)")
    for ours, theirs, impl in (("labkit stage 1", "ZeroRedundancyOptimizer",
                                "torch.distributed.optim.ZeroRedundancyOptimizer + DDP"),
                               ("labkit stage 3", "FSDP2 fully_shard",
                                "torch.distributed.fsdp.fully_shard (FSDP2)")):
        step = {k: max(median(r[k]["step_s"][WARMUP:]) for r in ranks) for k in (ours, theirs)}
        peak = {k: max(r[k]["peak"] for r in ranks) for k in (ours, theirs)}
        a, b = ranks[0][ours]["params"], ranks[0][theirs]["params"]
        diff = reference.max_param_diff(a, b)
        close = sum(int(((a[k] - b[k]).abs() <= 1e-5).sum()) for k in a) / psi
        diff_ref = (reference.max_param_diff(a, ref["params"]),
                    reference.max_param_diff(b, ref["params"]))
        t_ratio, m_ratio = step[ours] / step[theirs], peak[ours] / peak[theirs]
        print(f"\n{ours} vs {theirs}")
        print(f"  step (median wall): {step[ours] * 1e3:7.1f} ms vs {step[theirs] * 1e3:7.1f} ms"
              f"  ratio {t_ratio:.2f}  (target <= 1.3)")
        print(f"  peak heap per rank: {peak[ours] / 1e6:7.2f} MB vs {peak[theirs] / 1e6:7.2f} MB"
              f"  ratio {m_ratio:.2f}  (target <= 1.1)")
        print(f"  max |param difference|: {diff:.2e}, {close:.4%} of elements within 1e-5 "
              f"(vs single-device reference: labkit {diff_ref[0]:.2e}, torch {diff_ref[1]:.2e})")
        common = dict(benchmark="zero", labkit_impl=f"labkit.zero {ours[7:]}", torch_impl=impl,
                      world_size=WORLD_SIZE)
        notes = f"tiny GPT {psi} params, Adam fp32, gloo CPU, {STEPS - WARMUP} timed steps"
        rows += [
            dict(common, metric="step_s_median", labkit=f"{step[ours]:.4f}",
                 torch=f"{step[theirs]:.4f}", ratio=f"{t_ratio:.2f}", notes=notes),
            dict(common, metric="peak_heap_bytes_per_rank", labkit=f"{peak[ours]:.0f}",
                 torch=f"{peak[theirs]:.0f}", ratio=f"{m_ratio:.2f}",
                 notes=notes + "; glibc mallinfo2 in-use bytes above the pre-build baseline"),
            dict(common, metric="max_param_diff", labkit=f"{diff_ref[0]:.2e}",
                 torch=f"{diff_ref[1]:.2e}", ratio=f"{diff:.2e}",
                 notes=f"labkit/torch columns: vs single-device reference; ratio column: "
                       f"labkit vs torch; {close:.4%} of elements within 1e-5 (Adam turns "
                       f"rounding noise in near-zero gradients into ~lr steps)"),
        ]
    if "--dry-run" not in sys.argv:
        append_rows(rows)


if __name__ == "__main__":
    main()
