"""labkit's ring attention against single-device `scaled_dot_product_attention` (and torch's own
context parallelism where it runs).

One causal attention forward + backward on (1, 8, 1024, 64) fp32 q, k, v, in one launch of N
ranks (gloo on CPU), interleaved rounds (bench/common.py):
  labkit ring     `ring_attention(q, k, v, causal=True, layout="zigzag")` on each rank's 1024/N
                  tokens: the slowest rank's wall time;
  labkit gather   `all_gather_attention` (Llama 3's way), the same shards;
  torch (1 dev)   `F.scaled_dot_product_attention(q, k, v, is_causal=True)` on the whole
                  sequence in rank 0 alone, given every rank's threads (the others wait at a
                  barrier): what the N ranks replace.
Instrumentation off on every side (`ctx.off_the_record()`). saved_bytes: what autograd keeps
for backward (labkit's MemoryTracker on both sides: per rank for labkit, the one device for
torch). labkit_over_torch = labkit / torch. The outputs and q, k, v gradients of both labkit
sides are checked against the single-device result (atol 1e-5).
torch.distributed.tensor.experimental.context_parallel: tried once per run on a tiny input; on
CPU it does not run (its ring handlers cover only the CUDA flash / efficient / cuDNN attention
ops), and the bench prints the error it gives.
Run: python bench/context_parallel.py   (rows replace their earlier versions in data/bench.csv)
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from common import compared_row, interleaved_rounds, replace_rows  # noqa: E402
from labkit.parallel import context_parallelism as cp  # noqa: E402
from labkit.runtime.memory import MemoryTracker  # noqa: E402

WORLDS, BATCH, HEADS, SEQ, HEAD_DIM = (2, 4), 1, 8, 1024, 64
TIMED, ROUNDS = 3, 5
LAYOUT = "zigzag"


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=g) for _ in range(4)]


def _step(fn, tensors, grad):
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(grad)
    return out, [t.grad for t in leaves]


def _saved_bytes(fn, tensors, grad):
    tracker = MemoryTracker()
    leaves = [t.detach().requires_grad_() for t in tensors]
    with tracker.track_activations():
        out = fn(*leaves)
    out.backward(grad)
    return tracker.max_saved_bytes


def _torch_context_parallel(ctx):
    """Try torch's own CP once on a tiny input; '' if it runs, else its error (one line)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        q, k, v = (torch.randn(1, 2, 8 * ctx.world_size, 8) for _ in range(3))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return ""
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def compare(ctx):
    q, k, v, do = _inputs()
    threads = torch.get_num_threads()
    mine = [cp.shard_sequence(t, None, LAYOUT, dim=2) for t in (q, k, v, do)]
    sides = dict(ring=lambda *t: cp.ring_attention(*t, causal=True, layout=LAYOUT),
                 gather=lambda *t: cp.all_gather_attention(*t, causal=True, layout=LAYOUT))
    one_device = lambda *t: F.scaled_dot_product_attention(*t, is_causal=True)  # noqa: E731
    with ctx.off_the_record():
        expected, expected_grads = _step(one_device, (q, k, v), do)
        equal = True
        for fn in sides.values():
            out, grads = _step(fn, mine[:3], mine[3])
            want = [expected] + expected_grads
            equal &= all(torch.allclose(a, cp.shard_sequence(b, None, LAYOUT, dim=2), atol=1e-5)
                         for a, b in zip([out] + grads, want))
        saved = {name: _saved_bytes(fn, mine[:3], mine[3]) for name, fn in sides.items()}
        saved["torch"] = _saved_bytes(one_device, (q, k, v), do)

        def timed(run):
            def measure():
                per_step = []
                for _ in range(TIMED):
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    per_step.append(time.perf_counter() - start)
                slowest = torch.tensor([sorted(per_step)[TIMED // 2]], dtype=torch.float64)
                dist.all_reduce(slowest, dist.ReduceOp.MAX)
                return slowest.item()
            return measure

        def torch_side():
            if ctx.rank == 0:   # one device with all the ranks' threads; the others wait
                torch.set_num_threads(threads * ctx.world_size)
                _step(one_device, (q, k, v), do)
                torch.set_num_threads(threads)
        times = interleaved_rounds(
            {"ring": timed(lambda: _step(sides["ring"], mine[:3], mine[3])),
             "gather": timed(lambda: _step(sides["gather"], mine[:3], mine[3])),
             "torch": timed(torch_side)}, rounds=ROUNDS)
    return dict(times=times, saved=saved, equal=bool(equal), torch_cp=_torch_context_parallel(ctx))


def main():
    rows = []
    setting = (f"causal attention fwd+bwd, b={BATCH} h={HEADS} s={SEQ} d={HEAD_DIM} fp32, "
               f"{LAYOUT}; gloo CPU, {os.cpu_count()} cores; {ROUNDS} "
               f"interleaved rounds x {TIMED} steps (median step, slowest rank)")
    print(setting)
    for world in WORLDS:
        t0 = time.time()
        results = labkit.launch(compare, world, timeout_s=1800)
        r0 = results[0]
        assert all(r["equal"] for r in results), "labkit's CP attention differs from one device"
        print(f"\nN={world} ({time.time() - t0:.0f} s); outputs and gradients equal one device: "
              f"True; torch context_parallel on CPU: {r0['torch_cp'] or 'runs'}")
        base = dict(benchmark="context_parallel", world_size=world,
                    torch_impl="F.scaled_dot_product_attention, 1 device, whole sequence")
        for side, impl in (("ring", "ring_attention (zigzag)"),
                           ("gather", "all_gather_attention (zigzag)")):
            row = compared_row(dict(base, labkit_impl=impl), "step_s_median",
                               r0["times"][side], r0["times"]["torch"],
                               notes=setting + "; instrumentation off")
            saved = max(r["saved"][side] for r in results)
            rows += [row, dict(base, labkit_impl=impl, metric="saved_bytes_per_rank",
                               labkit=saved, torch=r0["saved"]["torch"],
                               labkit_over_torch=f"{saved / r0['saved']['torch']:.2f}",
                               notes="what autograd keeps for backward (MemoryTracker)")]
            print(f"  {impl}: step {float(row['labkit']) * 1e3:.1f} ms vs "
                  f"{float(row['torch']) * 1e3:.1f} ms on one device; "
                  f"labkit_over_torch {row['labkit_over_torch']} "
                  f"({row['spread_min']}-{row['spread_max']}); saved for backward {saved} B per "
                  f"rank vs {r0['saved']['torch']} B ({saved / r0['saved']['torch']:.2f})")
        if r0["torch_cp"]:
            rows.append(dict(base, labkit_impl="ring_attention (zigzag)",
                             torch_impl="torch.distributed.tensor.experimental.context_parallel",
                             metric="runs_on_cpu_gloo", labkit="yes", torch="no",
                             notes=r0["torch_cp"]))
    replace_rows(rows)
    print(f"\n{len(rows)} rows written to data/bench.csv")


if __name__ == "__main__":
    main()
