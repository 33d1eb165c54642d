"""The planner's whole search for Llama 3.1 405B on 16,384 H100s (target: under a second on 2
cores), and the published runs beside their predictions. Run: python bench/planner.py"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labkit.theory import planner  # noqa: E402


def main(rounds=5):
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        out = planner.plan("llama-3.1-405b", 16384, "H100", global_batch=2048, seq=8192)
        times.append(time.perf_counter() - started)
    best = out["plans"][0]
    print(f"Llama 3.1 405B on 16,384 H100: {out['considered']} plans considered, "
          f"search {statistics.median(times) * 1e3:.0f} ms median "
          f"({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f} ms over {rounds} rounds)")
    print(f"  best: dp={best['dp']} tp={best['tp']} pp={best['pp']} v={best['v']} "
          f"mbs={best['micro_batch_size']} ZeRO-{best['zero_stage']} {best['recompute']} "
          f"sp={best['sequence_parallel']}: modelled MFU {best['mfu']:.1%}")
    for use in ("calibration", "check"):
        print(f"\n{use} rows (published vs modelled TFLOP/s per GPU):")
        for row in planner.published_check(planner.published_runs(use)):
            print(f"  {row['name']:<30} {float(row['tflops_per_gpu']):6.0f} "
                  f"{row['predicted']:7.1f}  {row['error']:+6.1%}  ({row['metric']})")


if __name__ == "__main__":
    main()
