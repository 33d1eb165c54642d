"""labkit's batching engine against serving the same requests one at a time with plain greedy
generation (lesson 09's `generate`: the model and a KV cache, nothing else).

PyTorch has no request scheduler of its own; the anchor is what a server without batching does:
each request's prompt, then its tokens, one request after another. Both sides serve the same 16
requests (all arrived at time 0: offline throughput; prompts 8-32, outputs 4-16 tokens, labkit's
tiny GPT with 2 layers) in one process, in interleaved rounds (the order alternates):
  tokens_per_s  output tokens / wall seconds to serve all 16 (median over rounds, spread);
  both sides' tokens must be equal (the bench stops otherwise).
labkit_impl names the engine's setting: continuous batching (max batch 8) on a paged cache
(blocks of 8), and static batching on the same cache. labkit_over_torch above 1 here means
labkit serves more tokens per second (a throughput, not a time). On CPU with a model this small
the gain is modest (measured 1.0-1.3x across runs on 2 shared cores): the engine's per-request
attention and block gathers are Python loops, while batching pays off where a step is bound by
reading the weights (a GPU decode step: lesson 10's modelled clock).

The stream (issue 30): ONE Poisson stream of 32 requests (200 per second, seeded; outputs 4-32
tokens; every 6th prompt 1024 tokens long, the rest 8-32) whose arrivals overlap (the engine
runs up to 16 at once), served in four settings in 7 interleaved rounds (wall clock, arrivals
slept for). Each row's labkit column is the technique, its torch column the baseline it is
judged against (one engine, so both are labkit's; the ratio is technique / baseline):
  continuous vs static batching (both paged, blocks of 8): output tokens/s, p99 TTFT, p99 E2E;
  paged (blocks of 8) vs contiguous (each request reserves the model's 1056 positions), in the
    same pool of 4 x 1056 token slots: the peak requests running and the mean bytes reserved
    but holding no token over the steps (the cache's own stats);
  chunked prefill (128 prompt tokens per step) vs whole prompts (both continuous, paged): p99
    time between consecutive tokens of a request (TBT; a decode stalled behind a long prompt)
    and p99 TPOT.
Every time metric is also given on the engine's modelled clock (llama-3-8b on one H100,
roofline per step; one deterministic run each, labelled modelled): on CPU a step's cost grows
with the batch (per-request Python loops), so batching gains little there, while a GPU decode
step is bound by reading the weights once for the whole batch.
Every run's tokens must equal each request served alone (the bench stops otherwise).
Measured on 2 shared cores (load about 2.2-2.5, three runs): continuous over static x1.05-1.19
tokens/s, x0.77-0.91 p99 TTFT, x0.88-1.00 p99 E2E (wall; noisy); paged ran x4 the requests (16
vs 4) holding x0.01 the unused bytes; chunked prefill's p99 TBT x0.11-0.14 (wall), p99 TPOT
x0.29-0.33. On the modelled H100 clock (deterministic; the pricing of lesson 09's one time
model, rerun 2026-12-06 with vLLM's names, fcfs): continuous over static x1.45 tokens/s, x0.44
p99 TTFT, x0.62 p99 E2E; chunked prefill x0.29 p99 TBT, x0.45 p99 TPOT.
Run: python bench/serving_systems.py   (rows replace their own in data/bench.csv)
"""
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import compared_row, interleaved_rounds, median, replace_rows  # noqa: E402
from labkit import models  # noqa: E402
from labkit.parallel.batching import Engine, Request  # noqa: E402
from labkit.parallel.paged_kv import PagedKVCache  # noqa: E402
from labkit.runs.stream import kv_summary  # noqa: E402
from labkit.parallel.serving import generate  # noqa: E402
from labkit.theory import catalog, hardware, serving_stream as theory  # noqa: E402

N, ROUNDS = 16, 5


def setup():
    model = models.build("gpt", seed=0, seq=48, layers=2).eval()
    g = torch.Generator().manual_seed(0)
    stream = theory.poisson_stream(N, 1.0, (8, 32), (4, 16), seed=0)
    prompts = [torch.randint(0, 128, (r["prompt"],), generator=g) for r in stream]
    return model, stream, prompts


def offline():
    """The engine against one request at a time, all 16 requests at t=0."""
    model, stream, prompts = setup()
    tokens = sum(r["output"] for r in stream)
    results = {}

    def alone():
        start = time.perf_counter()
        results["alone"] = [generate(model, p[None], r["output"])[0].tolist()
                            for p, r in zip(prompts, stream)]
        return tokens / (time.perf_counter() - start)

    def engine(policy):
        def measure():
            reqs = [Request(r["id"], p, r["output"], 0.0) for p, r in zip(prompts, stream)]
            cache = PagedKVCache(2, 64, N * 48 // 8, 8)
            start = time.perf_counter()
            done = Engine(model, cache, policy, max_num_seqs=8).run(reqs)
            rate = tokens / (time.perf_counter() - start)
            results[policy] = [r.generated for r in done]
            return rate
        return measure

    rounds = interleaved_rounds(dict(alone=alone, continuous=engine("continuous"),
                                     static=engine("static")), rounds=ROUNDS)
    for policy in ("continuous", "static"):
        if results[policy] != results["alone"]:
            raise SystemExit(f"{policy} batching changed some request's tokens")
    rows = []
    for policy in ("continuous", "static"):
        rows.append(compared_row(
            dict(benchmark="serving_systems", torch_impl="generate, one request at a time",
                 labkit_impl=f"Engine {policy} (max batch 8, paged blocks of 8)", world_size=1),
            "tokens_per_s", rounds[policy], rounds["alone"], value_format="{:.1f}",
            notes=f"measured wall clock; {N} requests at t=0, tokens equal"))
        print(f"{policy:>10}: {rows[-1]['labkit']} tokens/s vs one at a time "
              f"{rows[-1]['torch']} (x{rows[-1]['labkit_over_torch']}, measured)")
    return rows


# ------------------------------------------------------------------ one stream, four settings
OUT = (4, 32)
STREAM_N, RATE, LONG, EVERY, SEQ, POOL_SEQS, MAX_BATCH, BLOCK, CHUNK = (
    32, 200.0, 1024, 6, 1056, 4, 16, 8, 128)
STREAM_ROUNDS = 7
SETTINGS = dict(continuous=("continuous", True, None), static=("static", True, None),
                contiguous=("continuous", False, None), chunked=("continuous", True, CHUNK))
FORMATS = dict(tokens_per_s="{:.1f}", peak_running="{:.0f}", wasted_bytes="{:.0f}")
NAMES = dict(continuous=f"Engine continuous (max batch {MAX_BATCH}, paged blocks of {BLOCK})",
             static=f"Engine static (max batch {MAX_BATCH}, paged blocks of {BLOCK})",
             contiguous=f"Engine continuous, contiguous KV (each reserves {SEQ} slots)",
             chunked=f"Engine continuous, paged, chunked prefill ({CHUNK} tokens per step)")


def stream_setup():
    """The one stream: Poisson arrivals, every EVERY-th prompt LONG tokens (seeded)."""
    stream = theory.poisson_stream(STREAM_N, RATE, (8, 32), OUT, seed=1)
    stream = [dict(r, prompt=LONG) if r["id"] % EVERY == EVERY // 2 else r for r in stream]
    model = models.build("gpt", seed=0, seq=SEQ, layers=2).eval()
    g = torch.Generator().manual_seed(1)
    prompts = {r["id"]: torch.randint(0, 128, (r["prompt"],), generator=g) for r in stream}
    alone = {r["id"]: generate(model, prompts[r["id"]][None], r["output"])[0].tolist()
             for r in stream}
    return model, stream, prompts, alone


def serve_stream(model, stream, prompts, alone, setting, step_time=None):
    """Serve the stream in one setting; the metrics of the run (tokens checked)."""
    policy, paged, chunk = SETTINGS[setting]
    width = model.cfg.hidden
    cache = (PagedKVCache(2, width, POOL_SEQS * SEQ // BLOCK, BLOCK) if paged
             else PagedKVCache.contiguous(2, width, SEQ, POOL_SEQS * SEQ))
    engine = Engine(model, cache, policy, max_num_seqs=MAX_BATCH, max_num_batched_tokens=chunk,
                    step_time=step_time)
    done = {r.id: r for r in engine.run([Request(r["id"], prompts[r["id"]], r["output"],
                                                 r["arrival_s"]) for r in stream])}
    if any(done[i].generated != alone[i] for i in alone):
        raise SystemExit(f"{setting}: some request's tokens differ from it served alone")
    records = [dict(r, **theory.request_metrics(r["arrival_s"], done[r["id"]].token_times,
                                                r["output"])) for r in stream]
    gaps = [b - a for q in done.values() for a, b in zip(q.token_times, q.token_times[1:])]
    s = theory.summarise(records, gaps=gaps)
    lat = s["latency"]
    return dict(tokens_per_s=s["throughput_tokens_per_s"], p99_ttft_s=lat["ttft_s"]["p99"],
                p99_e2e_s=lat["e2e_s"]["p99"], p99_tbt_s=lat["tbt_s"]["p99"],
                p99_tpot_s=lat["tpot_s"]["p99"],
                peak_running=max(st["batch"] for st in engine.steps),
                wasted_bytes=kv_summary(engine.steps)["wasted_bytes"],
                pool_bytes=cache.nbytes(), preemptions=sum(q.preemptions for q in done.values()))


def stream_rows():
    load = os.getloadavg()[0]
    model, stream, prompts, alone = stream_setup()
    rounds = interleaved_rounds({k: (lambda k=k: serve_stream(model, stream, prompts, alone, k))
                                 for k in SETTINGS}, rounds=STREAM_ROUNDS)
    pools = {r["pool_bytes"] for side in rounds.values() for r in side}
    if len(pools) != 1:
        raise SystemExit(f"the caches differ in bytes ({sorted(pools)}): not the same memory")
    long_n = sum(r["prompt"] == LONG for r in stream)
    where = (f"one Poisson stream of {STREAM_N} requests at {RATE:g}/s ({long_n} prompts of "
             f"{LONG} tokens, the rest 8-32; outputs {OUT[0]}-{OUT[1]}), tiny GPT 2 layers; "
             f"tokens equal to each request alone; load average {load:.1f} at the start")
    pairs = [("continuous", "static", m, "measured wall clock") for m in
             ("tokens_per_s", "p99_ttft_s", "p99_e2e_s")]
    pairs += [("continuous", "contiguous", m, f"measured by the cache's stats, both pools "
               f"{next(iter(pools))} bytes") for m in ("peak_running", "wasted_bytes")]
    pairs += [("chunked", "continuous", m, "measured wall clock") for m in
              ("p99_tbt_s", "p99_tpot_s")]
    rows = []
    for tech, base, metric, how in pairs:
        rows.append(compared_row(
            dict(benchmark="serving_systems", labkit_impl=NAMES[tech], torch_impl=NAMES[base],
                 world_size=1), metric, [r[metric] for r in rounds[tech]],
            [r[metric] for r in rounds[base]], notes=f"{how}; {where}",
            value_format=FORMATS.get(metric, "{:.4f}")))
    h100 = partial(theory.modelled_step_s, catalog.model("llama-3-8b"), hardware.gpu("H100"))
    modelled = {k: serve_stream(model, stream, prompts, alone, k, step_time=h100)
                for k in ("continuous", "static", "chunked")}
    timed = [(t, b, m) for t, b, m, how in pairs if how == "measured wall clock"]
    for tech, base, metric in timed:
        row = compared_row(
            dict(benchmark="serving_systems", labkit_impl=NAMES[tech], torch_impl=NAMES[base],
                 world_size=1), f"{metric}_modelled_h100", [modelled[tech][metric]],
            [modelled[base][metric]], value_format=FORMATS.get(metric, "{:.4f}"),
            notes=f"modelled: engine clock for llama-3-8b on one H100 (roofline per step, one "
                  f"deterministic run each); {where}")
        rows.append(dict(row, spread_min="", spread_max="", rounds=""))   # one-shot numbers
    preempted = {k: median([r["preemptions"] for r in v]) for k, v in rounds.items()}
    return rows, preempted


def main():
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = offline()
    stream, preempted = stream_rows()
    for row in stream:
        print(f"{row['metric']:>26}: {row['labkit']} vs {row['torch']} "
              f"(x{row['labkit_over_torch']}, {row['spread_min']}-{row['spread_max']}) "
              f"{row['labkit_impl']} / {row['torch_impl']}")
    print(f"median preemptions per run: {preempted}; bench took "
          f"{time.perf_counter() - start:.0f} s")
    replace_rows(rows + stream)


if __name__ == "__main__":
    main()
