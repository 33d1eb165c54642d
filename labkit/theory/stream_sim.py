"""A request stream served on a modelled GPU without running a model: the batching engine's
scheduler (labkit.parallel.batching.Engine: static or continuous batching, at most
max_num_seqs running, a token budget max_num_batched_tokens per step with or without chunked
prefill, blocks of a paged KV cache, preemption by recompute) replayed on token counts, each
step timed by `serving_stream.modelled_step_s` (a roofline per step). The tokens do not matter
to the schedule, only how many there are, so the times are those the engine's modelled clock
gives (tests/test_serving_more.py checks them step for step against the engine).

`plan_stream` answers `plan --serve --rate R`: TTFT, TPOT and vLLM's request_goodput
(requests per second meeting --ttft-ms and --tpot-ms; serving_metrics.py) of each policy, for
a catalog model whose weights fit one GPU, one replica per GPU, the stream dealt round robin.
All modelled. Plain Python: no torch.
"""
import math
from collections import deque
from dataclasses import dataclass, field
from functools import partial

from . import hardware, serving as model_serving, serving_stream as stream_theory
from .planner import RESERVED_BYTES, parse_model

BLOCK_SIZE = 16         # tokens per KV block: vLLM's default block size (vLLM docs, --block-size)
CHUNK = 512             # max_num_batched_tokens of the chunked policy: the token budget
                        # Sarathi-Serve (arXiv 2403.02310) runs under strict latency SLOs
POLICIES = (("static", None), ("continuous", None), ("continuous", CHUNK))
MAX_REQUESTS = 10_000   # a longer stream simulates for minutes (its percentiles settle sooner)
MAX_STREAM_S = 3.2e7    # a year of arrivals: beyond it, float64 seconds lose the microseconds
                        # a step takes (1e300 + 0.005 == 1e300: every latency would read 0)


@dataclass
class SimRequest:
    id: int
    prompt: int
    output: int
    arrival_s: float
    generated: int = 0
    cached: int = 0
    preemptions: int = 0
    token_times: list = field(default_factory=list)

    @property
    def length(self):
        return self.prompt + self.generated


class BlockCounts:
    """The paged cache's bookkeeping without its tensors: blocks held per request."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.held, self.free_count = {}, num_blocks

    def reserve(self, rid, tokens):
        need = -(-tokens // self.block_size) - self.held.get(rid, 0)
        if tokens > self.num_blocks * self.block_size or need > self.free_count:
            return False
        if need > 0:
            self.held[rid] = self.held.get(rid, 0) + need
            self.free_count -= need
        self.held.setdefault(rid, 0)
        return True

    def free(self, rid):
        self.free_count += self.held.pop(rid, 0)


def check_budget(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill=True):
    """The scheduler's knobs, one line each: max_num_seqs a positive integer; the token budget
    None (no cap) or an integer >= max_num_seqs (every running request's decode must fit a
    step, as vLLM requires); enable_chunked_prefill a bool."""
    for name, value in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        if value is None and name == "max_num_batched_tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_num_batched_tokens is not None and max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                         f"max_num_seqs ({max_num_seqs}): each running request's decode token "
                         "must fit in one step")
    if not isinstance(enable_chunked_prefill, bool):
        raise ValueError(f"enable_chunked_prefill must be True or False, got "
                         f"{enable_chunked_prefill!r}")


def check_fits_budget(rid, prompt, output, max_num_batched_tokens, enable_chunked_prefill):
    """Without chunked prefill a sequence is prefilled in one step, so the budget must hold the
    longest it can be (prompt + output - 1 tokens, recomputed after a preemption), as vLLM
    requires max_num_batched_tokens >= max_model_len then: else refused in one line."""
    if max_num_batched_tokens is None or enable_chunked_prefill:
        return
    if prompt + output - 1 > max_num_batched_tokens:
        raise ValueError(f"request {rid}: prompt {prompt} + output {output} - 1 tokens may be "
                         f"prefilled in one step, more than max_num_batched_tokens "
                         f"{max_num_batched_tokens} without chunked prefill: it could never be "
                         "scheduled (enable chunked prefill or raise the budget)")


def step_pieces(running, max_num_batched_tokens=None, enable_chunked_prefill=True):
    """The tokens each running request computes in the next step (the rule shared by
    `parallel/batching.Engine` and `simulate`): every decode first (one token each), then the
    prefills in arrival order, all within one token budget, `max_num_batched_tokens` (None: no
    cap), that counts the decode tokens too (Sarathi-Serve's budget, vLLM's scheduler). With
    chunked prefill a prompt is cut to what is left of the budget; without it a prompt is
    taken whole or waits for a later step, and so do the prompts behind it (first come, first
    served). Each request has `.length` (tokens so far) and `.cached` (tokens in the KV
    cache). Returns [(request, tokens)]; their sum never exceeds the budget."""
    budget = math.inf if max_num_batched_tokens is None else max_num_batched_tokens
    decodes = [r for r in running if r.length - r.cached == 1]
    pieces = [(r, 1) for r in decodes]
    budget -= len(decodes)
    for r in (r for r in running if r.length - r.cached > 1):
        todo = r.length - r.cached
        if todo > budget:
            if not enable_chunked_prefill or budget < 1:
                break
            todo = budget
        pieces.append((r, todo))
        budget -= todo
    return pieces


def simulate(stream, step_time, policy="continuous", max_num_seqs=8, max_num_batched_tokens=None,
             num_blocks=10**9, block_size=BLOCK_SIZE, *, enable_chunked_prefill=True,
             steps=None):
    """stream: [{id, prompt, output, arrival_s}]; step_time([(new, cached)]) -> seconds.
    Returns the SimRequests, finished, with token_times (seconds), in the order of the
    Engine's steps (admit up to max_num_seqs, pieces within max_num_batched_tokens with the
    decodes first, grow or preempt the newest, step). `steps`: a list to which each step's
    {time_s, batch, tokens, prefill_tokens} is appended, as the Engine's `steps`."""
    check_budget(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
    check_stream(stream, num_blocks * block_size)
    for r in stream:
        check_fits_budget(r["id"], r["prompt"], r["output"], max_num_batched_tokens,
                          enable_chunked_prefill)
    cache = BlockCounts(num_blocks, block_size)
    waiting = deque(SimRequest(r["id"], r["prompt"], r["output"], r["arrival_s"])
                    for r in sorted(stream, key=lambda r: r["arrival_s"]))
    running, finished, now = [], [], 0.0
    while waiting or running:
        if not (policy == "static" and running):
            while (waiting and waiting[0].arrival_s <= now and len(running) < max_num_seqs
                   and cache.reserve(waiting[0].id, waiting[0].length)):
                running.append(waiting.popleft())
        if not running:
            now += max(0.0, waiting[0].arrival_s - now)
            continue
        pieces = step_pieces(running, max_num_batched_tokens, enable_chunked_prefill)
        for r, todo in list(pieces):
            while r in running and not cache.reserve(r.id, r.cached + todo):
                victim = running.pop()
                cache.free(victim.id)
                victim.cached, victim.preemptions = 0, victim.preemptions + 1
                waiting.appendleft(victim)
        pieces = [(r, t) for r, t in pieces if r in running]
        now += step_time([(t, r.cached) for r, t in pieces])
        if steps is not None:
            steps.append(dict(time_s=now, batch=len(running), tokens=sum(t for _, t in pieces),
                              prefill_tokens=sum(t for r, t in pieces if t > 1 or
                                                 r.cached < r.prompt)))
        for r, todo in pieces:
            r.cached += todo
            if r.cached == r.length:
                r.generated += 1
                r.token_times.append(now)
        for r in [r for r in running if r.generated >= r.output]:
            running.remove(r)
            cache.free(r.id)
            finished.append(r)
    return sorted(finished, key=lambda r: r.id)


def check_stream(stream, pool_tokens):
    """Refuse, before the loop, a stream `simulate` could not finish: a request larger than
    the whole KV pool would wait for blocks forever, an arrival that is not a finite number of
    seconds >= 0 would never come (or come before the start)."""
    for r in stream:
        if not (isinstance(r["arrival_s"], (int, float)) and 0 <= r["arrival_s"] < math.inf):
            raise ValueError(f"request {r['id']}: arrival_s must be a finite number of seconds "
                             f">= 0, got {r['arrival_s']!r}")
        for name in ("prompt", "output"):
            if isinstance(r[name], bool) or not isinstance(r[name], int) or r[name] < 1:
                raise ValueError(f"request {r['id']}: {name} must be a positive integer, got "
                                 f"{r[name]!r}")
        if r["prompt"] + r["output"] > pool_tokens:
            raise ValueError(f"request {r['id']}: prompt {r['prompt']} + output {r['output']} "
                             f"tokens exceed the whole KV pool ({pool_tokens:,} token slots), "
                             "so it could never be admitted")


def check_plan_inputs(rate, requests, ttft_ms, tpot_ms):
    """`plan --serve --rate`'s numbers, one line each before anything is simulated."""
    if isinstance(requests, bool) or not isinstance(requests, int) or not \
            1 <= requests <= MAX_REQUESTS:
        raise ValueError(f"--requests must be an integer from 1 to {MAX_REQUESTS:,} (a longer "
                         f"stream simulates for minutes), got {requests!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise ValueError(f"--rate must be a positive finite number of requests per second, "
                         f"got {rate!r}")
    if requests / rate > MAX_STREAM_S:
        raise ValueError(f"--rate {rate:g}: {requests} requests would arrive over "
                         f"{requests / rate:.3g} s, more than a year ({MAX_STREAM_S:.2g} s); "
                         "give a larger --rate")
    for flag, value in (("--ttft-ms", ttft_ms), ("--tpot-ms", tpot_ms)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise ValueError(f"{flag} must be a positive finite number of milliseconds, got "
                             f"{value!r}")


def plan_stream(model, gpus, gpu="H100", *, rate, requests=200, prompt_len=1024,
                new_tokens=128, max_batch=64, chunk=CHUNK, ttft_ms=None, tpot_ms=None,
                kv_dtype="bf16", seed=0):
    """Each policy (static, continuous, continuous + chunked prefill) on `gpus` replicas of
    one GPU each, modelled: {model, cluster, workload, modelled, policies[{policy, chunk,
    latency, throughput_tokens_per_s, goodput, preemptions, steps}]}. Prompt and output
    lengths are uniform within +-50 % of prompt_len and new_tokens (seeded)."""
    check_plan_inputs(rate, requests, ttft_ms, tpot_ms)
    m, g = parse_model(model), hardware.gpu(gpu)
    usable, weights = g.memory_bytes - RESERVED_BYTES, m.param_count() * 2
    if weights >= usable:
        raise ValueError(f"--rate models one replica per GPU: {m.display_name}'s bf16 weights "
                         f"({weights / 1e9:.0f} GB) do not fit one {g.name} "
                         f"({usable / 1e9:.0f} GB usable)")
    for name, value in dict(gpus=gpus, max_batch=max_batch, chunk=chunk).items():
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                             f"got {value!r}")
    slots = (usable - weights) / model_serving.kv_bytes_per_token(m, kv_dtype)
    lengths = [(max(1, n // 2), max(1, n * 3 // 2)) for n in (prompt_len, new_tokens)]
    pool = int(slots // BLOCK_SIZE) * BLOCK_SIZE
    if lengths[0][1] + lengths[1][1] > pool:
        raise ValueError(f"--prompt-len {prompt_len} and --new-tokens {new_tokens}: the "
                         f"longest request (+50%: {lengths[0][1]:,} + {lengths[1][1]:,} tokens) "
                         f"exceeds the KV pool one {g.name} holds beside the weights "
                         f"({pool:,} token slots)")
    stream = stream_theory.poisson_stream(requests, rate, *lengths, seed=seed)
    step = partial(stream_theory.modelled_step_s, m, g, kv_dtype=kv_dtype)
    rows = []
    for policy, c in ((p, chunk if c else None) for p, c in POLICIES):
        done = [r for replica in range(min(gpus, requests)) for r in simulate(
            [r for r in stream if r["id"] % gpus == replica], step, policy, max_batch, c,
            int(slots // BLOCK_SIZE))]
        records = [dict(arrival_s=r.arrival_s, prompt=r.prompt, output=r.output,
                        **stream_theory.request_metrics(r.arrival_s, r.token_times, r.output))
                   for r in done]
        gaps = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
        s = stream_theory.summarise(records, ttft_ms, tpot_ms, gaps)
        rows.append(dict(policy=policy, chunk=c, max_num_batched_tokens=c, latency=s["latency"],
                         throughput_tokens_per_s=s["throughput_tokens_per_s"],
                         goodput=s["goodput"], request_goodput=s["request_goodput"],
                         preemptions=sum(r.preemptions for r in done)))
    return dict(model=dict(name=m.name, display_name=m.display_name, params=m.param_count()),
                cluster=dict(gpu=g.name, gpus=gpus, replicas=gpus, kv_token_slots=int(slots)),
                workload=dict(requests=requests, rate=rate, prompt_len=prompt_len,
                              new_tokens=new_tokens, max_batch=max_batch, block_size=BLOCK_SIZE,
                              kv_dtype=kv_dtype, ttft_ms=ttft_ms, tpot_ms=tpot_ms, seed=seed),
                modelled=True, policies=rows)


def format_stream_plan(out):
    """What `plan --serve --rate` prints: one row per policy, every number modelled."""
    c, w = out["cluster"], out["workload"]
    slo = (f"TTFT <= {w['ttft_ms']} ms, TPOT <= {w['tpot_ms']} ms"
           if w["ttft_ms"] is not None or w["tpot_ms"] is not None else "no SLO given")
    lines = [f"{out['model']['display_name']} on {c['gpus']} x {c['gpu']} (one replica each): "
             f"{w['requests']} requests at {w['rate']:g}/s, prompts ~{w['prompt_len']}, outputs "
             f"~{w['new_tokens']} tokens, at most {w['max_batch']} running per GPU; modelled",
             f"{'policy':<26}{'TTFT p50':>9}{'p99':>9}{'TPOT p50':>10}{'p99':>8}"
             f"{'tok/s':>9}{'goodput':>9}  ({slo}; ms, req/s)"]
    for p in out["policies"]:
        lat = p["latency"]
        name = p["policy"] + (f" + chunks of {p['chunk']}" if p["chunk"] else "")
        lines.append(f"{name:<26}{lat['ttft_s']['p50'] * 1e3:9.1f}{lat['ttft_s']['p99'] * 1e3:9.1f}"
                     f"{lat['tpot_s']['p50'] * 1e3:10.2f}{lat['tpot_s']['p99'] * 1e3:8.2f}"
                     f"{p['throughput_tokens_per_s']:9.0f}"
                     f"{p['goodput']['requests_per_s']:9.2f}")
    return "\n".join(lines)
