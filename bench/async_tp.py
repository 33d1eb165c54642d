"""Async TP against plain sequence-parallel TP, and whether PyTorch's own async TP runs here.

One launch of WORLD gloo ranks; the same MLP block (h -> ffn -> h, colwise then rowwise, the
sequence split over the ranks) split twice from the same weights: labkit's parallelize_module with
sequence_parallel=True (blocking all-gather before fc1, reduce-scatter after fc2) and with
async_tp=True (both as rings of isend/irecv under the chunk matmuls). Per side:
  step_s   the slowest rank's wall time of one forward + backward: the median over TIMED steps
           per round, interleaved rounds (bench/common.py, the order alternates), the median
           over rounds and the spread (min-max) of the per-round ratio async / plain;
           instrumentation off on both sides (`ctx.off_the_record()`: no comm log, no clock);
  equal    outputs and gathered gradients of the two sides agree (atol 1e-5).
Then torch.distributed._symmetric_memory's fused_all_gather_matmul on the same ranks: PyTorch's
async TP needs CUDA symmetric memory; where it does not run, the exact error is printed and
written in the notes (nothing is timed in its place).
Rows: benchmark "async_tp"; labkit = async_tp=True, torch = labkit's plain SP path (the
column names are the file's; labkit_over_torch = async / plain, below 1: async is faster).
Run: python bench/async_tp.py
"""
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from common import compared_row, interleaved_rounds, replace_rows, summary  # noqa: E402
from labkit.parallel import tensor_parallel as tp  # noqa: E402
from labkit.parallel.parallel_styles import parallelize_module  # noqa: E402

WORLD, BATCH, SEQ, HIDDEN, FFN = 2, 4, 256, 512, 2048
TIMED, ROUNDS = 3, 7
PLAN = {"0": "colwise", "2": "rowwise"}


def _step(module, x):
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.square().mean().backward()
    return y.detach()


def torch_async_tp(ctx):
    """Run PyTorch's fused_all_gather_matmul once; None if it ran, else the exact error."""
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group  # noqa: F401
        a, b = torch.randn(8, 16), torch.randn(16, 8)
        symm_mem = getattr(torch, "ops").symm_mem   # (torch.ops by name: cloudpickle can't)
        symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0,
                                         group_name=dist.group.WORLD.group_name)
        return None
    except Exception as error:   # noqa: BLE001 - reported as is, whatever it is
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def compare(ctx):
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
    x = torch.randn(BATCH, SEQ, HIDDEN).chunk(ctx.world_size, dim=1)[ctx.rank]
    sides = {name: parallelize_module(copy.deepcopy(full), None, PLAN, sequence_parallel=True,
                                      async_tp=name == "async")
             for name in ("async", "plain")}

    def measure(side):
        def one_round():
            times = []
            for _ in range(TIMED):
                dist.barrier()
                start = time.perf_counter()
                _step(sides[side], x)
                times.append(time.perf_counter() - start)
            return times
        return one_round
    with ctx.off_the_record():
        outs = {name: _step(m, x) for name, m in sides.items()}
        grads = {name: tp.gather_grads(m) for name, m in sides.items()}
        equal = torch.allclose(outs["async"], outs["plain"], atol=1e-5) and all(
            torch.allclose(g, grads["plain"][k], atol=1e-5) for k, g in grads["async"].items())
        rounds = interleaved_rounds({s: measure(s) for s in sides}, rounds=ROUNDS)
    return dict(rounds=rounds, equal=equal, torch_error=torch_async_tp(ctx))


def main():
    setting = (f"b={BATCH} s={SEQ} h={HIDDEN} ffn={FFN} fp32; gloo CPU, {os.cpu_count()} cores, "
               f"world {WORLD}; {ROUNDS} interleaved rounds x {TIMED} timed fwd+bwd")
    print(setting)
    results = labkit.launch(compare, WORLD, timeout_s=1200)
    per_round = {}
    for side in ("async", "plain"):   # per round: the median over steps of the slowest rank
        per_round[side] = [sorted(max(ts) for ts in zip(*(r["rounds"][side][k]
                                                           for r in results)))[TIMED // 2]
                           for k in range(ROUNDS)]
    s = summary(per_round["async"], per_round["plain"])
    equal = all(r["equal"] for r in results)
    error = results[0]["torch_error"]
    print(f"step: async {s['labkit'] * 1e3:.1f} ms vs plain {s['torch'] * 1e3:.1f} ms; "
          f"async / plain {s['labkit_over_torch']:.2f} (per-round {s['spread_min']:.2f}-"
          f"{s['spread_max']:.2f}); outputs and gradients equal: {equal}")
    print("torch.distributed._symmetric_memory.fused_all_gather_matmul on gloo/CPU: "
          + ("ran" if error is None else f"does not run here ({error})"))
    assert equal, "async and plain TP disagree"
    base = dict(benchmark="async_tp", world_size=WORLD,
                labkit_impl="parallelize(sequence_parallel=True, async_tp=True) MLP block",
                torch_impl="parallelize(sequence_parallel=True) plain (labkit)")
    note = (f"{setting}; labkit=async ring, torch column=labkit's plain SP path; "
            f"torch's fused_all_gather_matmul: {'ran' if error is None else error}; "
            "instrumentation off")
    replace_rows([compared_row(base, "mlp_step_s_median", per_round["async"],
                               per_round["plain"], notes=note)])
    print("1 row written to data/bench.csv")


if __name__ == "__main__":
    main()
