"""The planner against every published run in data/published_runs.csv, side by side with
`llm-analysis` (pip package 0.2.2: a constant-efficiency model; flops_efficiency=0.5, as its own
comment suggests), and the whole 405B / 16,384-GPU search timed (target: under a second).

Each tool gets the row's published layout (dp, tp, pp, micro-batch, recompute where stated);
llm-analysis has no context parallelism, interleaving or fp8, so it sees cp folded into dp and
the bf16 peak. Errors are predicted / published - 1 in TFLOP/s per GPU (labkit's convention,
6 N + 12 L h s per token; rows that publish tokens/s are compared in tokens). MAE: the mean of
|error|. Calibration rows are what labkit was fitted on; check rows were never fitted to.
Run: python bench/planner.py [--rounds N] [--write] [--fit]; --fit refits the one fitted number
(kernels.IN_STEP_GEMM_FRACTION) on the calibration rows and prints it beside the stored one
(data/kernels.csv keeps the stored value; tests/test_planner_fit.py holds the two equal);
--write saves both tools' predictions to
data/planner_check.csv (lesson 06 reads llm-analysis's column from it, so the lesson needs no
llm-analysis). Install the comparison without its Hugging Face extras:
pip install --no-deps llm-analysis==0.2.2 "fire>=0.5,<0.6"
"""
import argparse
import contextlib
import csv
import io
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labkit.theory import hardware, planner, published, transformer as tf  # noqa: E402

LLM_ANALYSIS_EFFICIENCY = 0.5


def llm_analysis_configs(name, m, g, seq, intra_link, inter_link, gpus_per_node):
    """llm-analysis's ModelConfig and GPUConfig for labkit's model shape `m` on GPU `g` (the
    row's own links; the inter-node bandwidth is the node's NICs together)."""
    from llm_analysis.config import GPUConfig, ModelConfig
    model = ModelConfig(name=name, num_layers=m.layers, n_head=m.heads,
                        hidden_dim=m.hidden, vocab_size=m.vocab, max_seq_len=seq,
                        num_key_value_heads=m.kv_heads, ffn_embed_dim=m.ffn,
                        expansion_ratio=m.ffn / m.hidden,
                        moe_num_experts=m.experts, moe_top_k=m.top_k)
    gpu = GPUConfig(name=g.name, mem_per_GPU_in_GB=g.memory_bytes / 1e9,
                    hbm_bandwidth_in_GB_per_sec=g.memory_bw / 1e9,
                    intra_node_bandwidth_in_GB_per_sec=hardware.link(intra_link).bandwidth / 1e9,
                    intra_node_min_message_latency=8e-6,
                    peak_fp16_TFLOPS=g.bf16_flops / 1e12,
                    inter_node_bandwidth_in_GB_per_sec=hardware.link(inter_link).bandwidth
                    / 1e9 * gpus_per_node)
    return model, gpu


def llm_analysis_tflops(r):
    """llm-analysis's TFLOP/s per GPU for row `r` (labkit's FLOPs per token over its step time),
    or None where the package is not installed or refuses the row."""
    try:
        from llm_analysis import analysis as la
        from llm_analysis.config import DtypeConfig, ParallelismConfig
    except ImportError:
        return None
    m, g = planner.parse_model(r["model"]), hardware.gpu(r["gpu"])
    gpus, seq, batch = int(r["gpus"]), int(r["seq"]), int(r["global_batch"])
    tp, pp = int(r["tp"] or 1), int(r["pp"] or 1)
    dp = gpus // (tp * pp)
    mbs = int(r["micro_batch_size"] or 1)
    model, gpu = llm_analysis_configs(r["name"], m, g, seq, r["intra_link"], r["inter_link"],
                                      int(r["gpus_per_node"]))
    recompute = {"": 0, "none": 0, "selective": 1, "full": 2}[r["recompute"]]
    analysis = la.LLMAnalysis(model, gpu, DtypeConfig(),
                              ParallelismConfig(tp_size=tp, pp_size=pp, dp_size=dp,
                                                sp_size=tp),
                              flops_efficiency=LLM_ANALYSIS_EFFICIENCY)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            out = analysis.training(
                batch_size_per_gpu=mbs, global_batch_size=batch, seq_len=seq,
                activation_recomputation=la.ActivationRecomputation(recompute),
                ds_zero=la.DSZeRO(int(r["zero_stage"] or 0)),
                flash_attn=r["attention"] == "flash",
                mlp_gated_linear_units=not tf.is_gpt(m))
    except Exception as error:   # its asserts (e.g. a batch it cannot split): no prediction
        print(f"  llm-analysis refused {r['name']}: {str(error)[:80]}")
        return None
    tokens_per_s = batch * seq / out["latency_per_iter"] / gpus
    return tokens_per_s * tf.model_flops_per_token(m, seq) / 1e12


def search_time(rounds):
    """Wall and CPU seconds of the whole 405B / 16,384 H100 search, per round (CPU time does
    not count the other programs sharing this machine's cores)."""
    walls, cpus = [], []
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        out = planner.plan("llama-3.1-405b", 16384, "H100", global_batch=2048, seq=8192)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return out, walls, cpus


def compare(rows):
    """Per row: published, labkit and llm-analysis TFLOP/s per GPU and each tool's error."""
    out = []
    for r in published.check(rows):
        other = llm_analysis_tflops(r)
        out.append(dict(r, llm_analysis=other,
                        llm_error=None if other is None else other / r["published"] - 1))
    return out


def mae(values):
    values = [abs(v) for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def report(rows, title):
    print(f"\n{title} (TFLOP/s per GPU, labkit's convention; error = predicted / published - 1)")
    print(f"  {'run':<46} {'published':>9} {'labkit':>8} {'error':>7} {'llm-an.':>8} "
          f"{'error':>7}")
    for r in rows:
        other = "-" if r["llm_analysis"] is None else f"{r['llm_analysis']:8.1f}"
        other_error = "-" if r["llm_error"] is None else f"{r['llm_error']:+7.1%}"
        print(f"  {r['name'][:46]:<46} {r['published']:9.1f} {r['predicted']:8.1f} "
              f"{r['error']:+7.1%} {other:>8} {other_error:>7}")
    print(f"  mean absolute error: labkit {mae(r['error'] for r in rows):.1%}, llm-analysis "
          f"{mae(r['llm_error'] for r in rows):.1%} over {len(rows)} rows")


CHECK_CSV = Path(__file__).resolve().parents[1] / "data" / "planner_check.csv"


def write(rows, path=CHECK_CSV):
    """Both tools' predictions per published row (TFLOP/s per GPU, labkit's convention)."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["use", "name", "published", "labkit", "labkit_error", "llm_analysis",
                      "llm_analysis_error"])
        for r in rows:
            other = "" if r["llm_analysis"] is None else round(r["llm_analysis"], 1)
            other_error = "" if r["llm_error"] is None else round(r["llm_error"], 4)
            out.writerow([r["use"], r["name"], round(r["published"], 1),
                          round(r["predicted"], 1), round(r["error"], 4), other, other_error])


def main(rounds=5, save=False):
    logging.getLogger("llm_analysis").setLevel(logging.ERROR)
    out, walls, cpus = search_time(rounds)
    best = out["plans"][0]
    print(f"Llama 3.1 405B on 16,384 H100: {out['considered']} plans considered, search "
          f"{statistics.median(cpus):.2f} s of CPU median ({min(cpus):.2f}-{max(cpus):.2f}), "
          f"{statistics.median(walls):.2f} s wall ({min(walls):.2f}-{max(walls):.2f}) over "
          f"{rounds} rounds")
    print(f"  best: dp={best['dp']} tp={best['tp']} pp={best['pp']} v={best['v']} "
          f"mbs={best['micro_batch_size']} ZeRO-{best['zero_stage']} "
          f"{planner.recompute_label(best)} sp={best['sequence_parallel']}: modelled MFU "
          f"{best['mfu']:.1%}")
    everything = []
    for use in ("calibration", "check"):
        rows = compare(published.runs(use))
        report(rows, f"{use} rows")
        everything += rows
    if save:
        write(everything)
        print(f"\nwrote {CHECK_CSV}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="save data/planner_check.csv")
    parser.add_argument("--fit", action="store_true",
                        help="refit in_step_gemm_fraction on the calibration rows and stop")
    args = parser.parse_args()
    if args.fit:
        from labkit.theory import kernels
        print(f"in_step_gemm_fraction fitted on the calibration rows: "
              f"{published.fit_in_step_gemm_fraction()} (data/kernels.csv: "
              f"{kernels.IN_STEP_GEMM_FRACTION})")
    else:
        main(args.rounds, args.write)
