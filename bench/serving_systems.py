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
the gain is modest (measured 1.3x on 2 shared cores): the engine's per-request attention and
block gathers are Python loops, while batching pays off where a step is bound by reading the
weights (a GPU decode step: lesson 10's modelled clock).
Run: python bench/serving_systems.py   (rows replace their own in data/bench.csv)
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_rounds, median, replace_rows  # noqa: E402
from labkit import models  # noqa: E402
from labkit.parallel.batching import Engine, Request  # noqa: E402
from labkit.parallel.paged_kv import PagedKVCache  # noqa: E402
from labkit.parallel.serving import generate  # noqa: E402
from labkit.theory import serving_stream as theory  # noqa: E402

N, ROUNDS = 16, 5


def setup():
    model = models.build("gpt", seed=0, seq=48, layers=2).eval()
    g = torch.Generator().manual_seed(0)
    stream = theory.poisson_stream(N, 1.0, (8, 32), (4, 16), seed=0)
    prompts = [torch.randint(0, 128, (r["prompt"],), generator=g) for r in stream]
    return model, stream, prompts


def main():
    torch.set_num_threads(1)
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
            done = Engine(model, cache, policy, max_batch=8).run(reqs)
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
        ratios = [a / b for a, b in zip(rounds[policy], rounds["alone"])]
        rows.append(dict(benchmark="serving_systems",
                         labkit_impl=f"Engine {policy} (max batch 8, paged blocks of 8)",
                         torch_impl="generate, one request at a time", world_size=1,
                         metric="tokens_per_s", labkit=round(median(rounds[policy]), 1),
                         torch=round(median(rounds["alone"]), 1),
                         labkit_over_torch=round(median(ratios), 2),
                         spread_min=round(min(ratios), 2), spread_max=round(max(ratios), 2),
                         rounds=ROUNDS, notes=f"{N} requests at t=0, tokens equal"))
        print(f"{policy:>10}: {rows[-1]['labkit']} tokens/s vs one at a time "
              f"{rows[-1]['torch']} (x{rows[-1]['labkit_over_torch']}, measured)")
    replace_rows(rows)


if __name__ == "__main__":
    main()
