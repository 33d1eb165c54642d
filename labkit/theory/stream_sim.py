"""A request stream served on a modelled GPU without running a model: the batching engine's
scheduler (labkit.parallel.batching.Engine: static or continuous batching, at most
max_num_seqs running, a token budget max_num_batched_tokens per step with or without chunked
prefill, blocks of a paged KV cache with or without automatic prefix caching, preemption by
recompute in vLLM's order under its fcfs or priority scheduling policy) replayed on token
counts, each
step timed by `serving_stream.modelled_step_s` (a roofline per step). The tokens do not matter
to the schedule, only how many there are, so the times are those the engine's modelled clock
gives (tests/test_serving_more.py checks them step for step against the engine).

Prefix caching without tokens: a request's full block i is named by what its tokens are, the
shared system prompt's ("prefix", prefix_id, i) while the block lies inside it (a row's
`prefix_len` tokens, or simulate's `shared_prefix`), its own ("request", id, i) beyond (its
tokens are its own), as the engine's chained hashes name them; `BlockPool` keeps vLLM v1's
free queue (LRU), cached blocks and hit counts as `parallel/paged_kv.PagedKVCache` does, so a
stream of n requests sharing a P-token prefix in blocks of B hits (n - 1) x floor(P / B) blocks
when each arrives after the one before is prefilled.

The KV pool of a modelled GPU (`kv_pool`, vLLM's gpu_memory_utilization): the engine may use
that fraction of the GPU's memory; the weights and the activation peak of a profiling forward
of max_num_batched_tokens tokens come off it, the rest is KV blocks (vLLM's
`determine_available_memory`; num_gpu_blocks_override gives the count instead).

`plan_stream` answers `plan --serve --rate R`: TTFT, TPOT and vLLM's request_goodput
(requests per second meeting --ttft-ms and --tpot-ms; serving_metrics.py) of each policy, for
a catalog model whose weights fit one GPU, one replica per GPU, the stream dealt round robin.
All modelled. Plain Python: no torch.
"""
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from functools import partial

from . import hardware, serving as model_serving, serving_stream as stream_theory
from .block_pool import BlockPool
from .planner import parse_model

BLOCK_SIZE = 16         # tokens per KV block: vLLM's default block size (vLLM docs, --block-size)
CHUNK = 512             # max_num_batched_tokens of the chunked policy: the token budget
                        # Sarathi-Serve (arXiv 2403.02310) runs under strict latency SLOs
POLICIES = (("static", None), ("continuous", None), ("continuous", CHUNK))
SCHEDULING_POLICIES = ("fcfs", "priority")    # vLLM's --scheduling-policy
GPU_MEMORY_UTILIZATION = 0.9                  # vLLM's default --gpu-memory-utilization
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
    priority: int = 0              # vLLM's: lower is served first (--scheduling-policy priority)
    prefix_id: object = 0          # which system prompt its first prefix_len tokens are
    prefix_len: int = 0

    @property
    def length(self):
        return self.prompt + self.generated

    def block_name(self, i, block_size):
        """Full block i's name: the system prompt's while the block lies inside it, else the
        request's own (what the engine's chained hash of the tokens up to the block's end
        tells apart)."""
        if (i + 1) * block_size <= min(self.prefix_len, self.prompt):
            return ("prefix", self.prefix_id, i)
        return ("request", self.id, i)


def _names(r, cache):
    """BlockPool's name(i, parent) for request r's full blocks (no tokens: block_name)."""
    return lambda i, parent: r.block_name(i, cache.block_size)


def check_scheduling_policy(policy):
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES} (vLLM's "
                         f"--scheduling-policy), got {policy!r}")


def _rank(r):
    """vLLM's order of requests under the priority policy: priority, then arrival (then id)."""
    return (r.priority, r.arrival_s, r.id)


def next_waiting(waiting, now, scheduling_policy="fcfs"):
    """The waiting request admitted next (None: none has arrived): under fcfs the head of the
    queue (arrival order, preempted requests put back at its front, as vLLM's
    waiting.prepend_request); under priority the arrived request of the lowest priority
    value, the earliest arrival among equals (vLLM's priority queue). `waiting` holds the
    preempted requests first, then the rest in arrival order (some not arrived yet)."""
    if not waiting or waiting[0].arrival_s > now:
        return None
    if scheduling_policy == "fcfs":
        return waiting[0]
    return min(itertools.takewhile(lambda r: r.arrival_s <= now, waiting), key=_rank)


def preemption_victim(running, scheduling_policy="fcfs"):
    """The running request preempted when the KV pool is short (vLLM v1's scheduler): under
    fcfs the one admitted last (`self.running.pop()`: with no re-admission, the latest
    arrival); under priority the largest (priority, arrival): the lowest priority, latest
    arrived among equals."""
    return running[-1] if scheduling_policy == "fcfs" else max(running, key=_rank)


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
             steps=None, scheduling_policy="fcfs", enable_prefix_caching=False,
             shared_prefix=0, cache=None):
    """stream: [{id, prompt, output, arrival_s[, priority, prefix_id, prefix_len]}];
    step_time([(new, cached)]) -> seconds. Returns the SimRequests, finished, with
    token_times (seconds), in the order of the Engine's steps (admit up to max_num_seqs in the
    scheduling policy's order, from the longest cached prefix with prefix caching; pieces
    within max_num_batched_tokens with the decodes first; grow or preempt the policy's victim;
    step). `steps`: a list to which each step's {time_s, batch, tokens, prefill_tokens} is
    appended, as the Engine's `steps`. shared_prefix: tokens of one system prompt every
    prompt begins with (a row's prefix_len overrides it). `cache`: a BlockPool to use (its
    prefix_stats() after the run: hits, hit rate, prefill tokens saved)."""
    check_budget(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
    check_scheduling_policy(scheduling_policy)
    check_stream(stream, num_blocks * block_size)
    for r in stream:
        check_fits_budget(r["id"], r["prompt"], r["output"], max_num_batched_tokens,
                          enable_chunked_prefill)
    cache = cache if cache is not None else BlockPool(
        num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    waiting = deque(SimRequest(r["id"], r["prompt"], r["output"], r["arrival_s"],
                               priority=r.get("priority", 0), prefix_id=r.get("prefix_id", 0),
                               prefix_len=r.get("prefix_len", shared_prefix))
                    for r in sorted(stream, key=lambda r: r["arrival_s"]))
    running, finished, now = [], [], 0.0
    while waiting or running:
        joining = not (policy == "static" and running)    # static: nobody joins a batch
        while joining and len(running) < max_num_seqs:
            r = next_waiting(waiting, now, scheduling_policy)
            hit = None if r is None else cache.admit_named(r.id, r.length, _names(r, cache))
            if hit is None and r is not None and not running:   # an empty pool: never fits
                raise ValueError(f"request {r.id} ({r.length} tokens) does not fit the whole KV "
                                 f"pool ({cache.num_blocks} blocks of {cache.block_size})")
            if hit is None:
                break
            r.cached = hit               # prefix caching: these tokens are not prefilled
            waiting.remove(r)
            running.append(r)
        if not running:
            now += max(0.0, waiting[0].arrival_s - now)
            continue
        pieces = step_pieces(running, max_num_batched_tokens, enable_chunked_prefill)
        for r, todo in list(pieces):
            while r in running and not cache.reserve(r.id, r.cached + todo):
                victim = preemption_victim(running, scheduling_policy)
                running.remove(victim)
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
            cache.commit_named(r.id, r.cached, _names(r, cache))
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


def activation_peak_bytes(m, tokens, max_num_seqs=1):
    """The activations a forward of `tokens` tokens holds at its peak (an estimate, bf16):
    inside one layer the residual, its normed copy, attention's input and output (~4 x
    hidden per token) beside the MLP's gate, up and activated rows (3 x ffn per routed
    expert); plus the fp32 logits of the max_num_seqs rows sampled. vLLM measures this peak
    with a profiling forward of max_num_batched_tokens tokens."""
    return tokens * (4 * m.hidden + 3 * m.ffn * m.top_k) * 2 + max_num_seqs * m.vocab * 4


def kv_pool(model, gpu="H100", *, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
            num_gpu_blocks_override=None, block_size=BLOCK_SIZE, kv_dtype="bf16",
            profile_tokens=8192, max_num_seqs=256):
    """The KV blocks one GPU holds for `model` (bf16 weights, one replica), as vLLM sizes its
    pool: the engine may use gpu_memory_utilization x the GPU's memory; the weights and the
    activation peak of a profiling forward of `profile_tokens` tokens come off it, the rest
    is blocks of block_size tokens; num_gpu_blocks_override gives the count instead (vLLM's
    name; the memory still has to hold the weights). Returns {memory_bytes, budget_bytes,
    weights_bytes, activation_bytes, kv_bytes, bytes_per_block, num_blocks, source}; weights
    and activations beyond the fraction: one-line ValueError."""
    m, g = parse_model(model), hardware.gpu(gpu) if isinstance(gpu, str) else gpu
    u = gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
        raise ValueError(f"--gpu-memory-utilization must be a fraction in (0, 1] of the GPU's "
                         f"memory, got {u!r}")
    n = num_gpu_blocks_override
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"--num-gpu-blocks-override must be a positive number of blocks, got "
                         f"{n!r}")
    budget, weights = u * g.memory_bytes, m.param_count() * 2
    activations = activation_peak_bytes(m, profile_tokens, max_num_seqs)
    per_block = block_size * model_serving.kv_bytes_per_token(m, kv_dtype)
    kv = budget - weights - activations
    share = (f"--gpu-memory-utilization {u:g} of one {g.name} ({budget / 1e9:.1f} of "
             f"{g.memory_bytes / 1e9:.1f} GB)")
    if weights >= budget:
        raise ValueError(f"{m.display_name}'s bf16 weights ({weights / 1e9:.1f} GB) do not fit "
                         f"{share}: raise the fraction or give the model more GPUs (plan "
                         "--serve without --rate)")
    if kv < per_block:
        raise ValueError(f"{m.display_name}'s bf16 weights ({weights / 1e9:.1f} GB) and "
                         f"activation peak ({activations / 1e9:.2f} GB) leave no KV block in "
                         f"{share}: raise the fraction or lower --max-num-batched-tokens")
    blocks = int(kv // per_block)
    return dict(memory_bytes=g.memory_bytes, gpu_memory_utilization=u, budget_bytes=budget,
                weights_bytes=weights, activation_bytes=activations, profile_tokens=profile_tokens,
                kv_bytes=kv, bytes_per_block=per_block, block_size=block_size,
                num_blocks=n if n is not None else blocks,
                source="num_gpu_blocks_override" if n is not None else "gpu_memory_utilization")


def plan_stream(model, gpus, gpu="H100", *, rate, requests=200, prompt_len=1024,
                new_tokens=128, max_num_seqs=64, max_num_batched_tokens=CHUNK, ttft_ms=None,
                tpot_ms=None, kv_dtype="bf16", seed=0,
                gpu_memory_utilization=GPU_MEMORY_UTILIZATION, num_gpu_blocks_override=None,
                enable_prefix_caching=False, shared_prefix=0, scheduling_policy="fcfs",
                max_batch=None, chunk=None, execution="graph"):
    """Each policy (static, continuous, continuous + chunked prefill within a budget of
    max_num_batched_tokens) on `gpus` replicas of one GPU each, modelled: {model, cluster,
    workload, kv_pool, modelled, policies[{policy, max_num_batched_tokens, latency,
    throughput_tokens_per_s, goodput, preemptions, prefix_cache}]}. Prompt and output lengths
    are uniform within +-50 % of prompt_len and new_tokens (seeded); shared_prefix: tokens of
    one system prompt every prompt begins with (prefix caching hits it). The KV pool per GPU:
    `kv_pool` (gpu_memory_utilization, or num_gpu_blocks_override). max_batch and chunk: the
    old names of max_num_seqs and max_num_batched_tokens."""
    max_num_seqs = max_batch if max_batch is not None else max_num_seqs
    budget = chunk if chunk is not None else max_num_batched_tokens
    check_plan_inputs(rate, requests, ttft_ms, tpot_ms)
    check_scheduling_policy(scheduling_policy)
    m, g = parse_model(model), hardware.gpu(gpu)
    for name, value in dict(gpus=gpus, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=budget).items():
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                             f"got {value!r}")
    if isinstance(shared_prefix, bool) or not isinstance(shared_prefix, int) or \
            shared_prefix < 0:
        raise ValueError(f"--shared-prefix must be a whole number of tokens >= 0, got "
                         f"{shared_prefix!r}")
    lengths = [(max(1, n // 2), max(1, n * 3 // 2)) for n in (prompt_len, new_tokens)]
    pool = kv_pool(m, g, gpu_memory_utilization=gpu_memory_utilization,
                   num_gpu_blocks_override=num_gpu_blocks_override, kv_dtype=kv_dtype,
                   profile_tokens=budget,
                   max_num_seqs=max_num_seqs)
    slots = pool["num_blocks"] * BLOCK_SIZE
    if lengths[0][1] + lengths[1][1] > slots:
        raise ValueError(f"--prompt-len {prompt_len} and --new-tokens {new_tokens}: the "
                         f"longest request (+50%: {lengths[0][1]:,} + {lengths[1][1]:,} tokens) "
                         f"exceeds the KV pool of one {g.name} ({slots:,} token slots, "
                         f"{pool['source']})")
    stream = stream_theory.poisson_stream(requests, rate, *lengths, seed=seed)
    step = partial(stream_theory.modelled_step_s, m, g, kv_dtype=kv_dtype, execution=execution)
    rows = []
    for policy, c in ((p, budget if c else None) for p, c in POLICIES):
        done, caches = [], []
        for replica in range(min(gpus, requests)):
            caches.append(BlockPool(pool["num_blocks"], BLOCK_SIZE,
                                    enable_prefix_caching=enable_prefix_caching))
            done += simulate([r for r in stream if r["id"] % gpus == replica], step, policy,
                             max_num_seqs, c, pool["num_blocks"],
                             scheduling_policy=scheduling_policy, shared_prefix=shared_prefix,
                             cache=caches[-1])
        records = [dict(arrival_s=r.arrival_s, prompt=r.prompt, output=r.output,
                        **stream_theory.request_metrics(r.arrival_s, r.token_times, r.output))
                   for r in done]
        gaps = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
        s = stream_theory.summarise(records, ttft_ms, tpot_ms, gaps)
        rows.append(dict(policy=policy, chunk=c, max_num_batched_tokens=c, latency=s["latency"],
                         throughput_tokens_per_s=s["throughput_tokens_per_s"],
                         goodput=s["goodput"], request_goodput=s["request_goodput"],
                         preemptions=sum(r.preemptions for r in done),
                         prefix_cache=prefix_totals([c.prefix_stats() for c in caches])))
    return dict(model=dict(name=m.name, display_name=m.display_name, params=m.param_count()),
                cluster=dict(gpu=g.name, gpus=gpus, replicas=gpus, kv_token_slots=slots),
                kv_pool=pool,
                workload=dict(requests=requests, rate=rate, prompt_len=prompt_len,
                              new_tokens=new_tokens, max_num_seqs=max_num_seqs,
                              max_batch=max_num_seqs, max_num_batched_tokens=budget,
                              block_size=BLOCK_SIZE, kv_dtype=kv_dtype, ttft_ms=ttft_ms,
                              tpot_ms=tpot_ms, seed=seed, scheduling_policy=scheduling_policy,
                              execution=execution,
                              enable_prefix_caching=enable_prefix_caching,
                              shared_prefix=shared_prefix),
                modelled=True, policies=rows)


def prefix_totals(stats):
    """Several pools' prefix_stats together: queries, hits, hit rate, prefill tokens saved,
    evictions."""
    queries, hits = sum(s["queries"] for s in stats), sum(s["hits"] for s in stats)
    return dict(queries=queries, hits=hits, hit_rate=hits / queries if queries else 0.0,
                prefill_tokens_saved=hits, evictions=sum(s["evictions"] for s in stats))


def format_stream_plan(out):
    """What `plan --serve --rate` prints: one row per policy, every number modelled."""
    c, w = out["cluster"], out["workload"]
    slo = (f"TTFT <= {w['ttft_ms']} ms, TPOT <= {w['tpot_ms']} ms"
           if w["ttft_ms"] is not None or w["tpot_ms"] is not None else "no SLO given")
    lines = [f"{out['model']['display_name']} on {c['gpus']} x {c['gpu']} (one replica each): "
             f"{w['requests']} requests at {w['rate']:g}/s, prompts ~{w['prompt_len']}, outputs "
             f"~{w['new_tokens']} tokens, max_num_seqs {w['max_num_seqs']} per GPU, "
             f"{w['scheduling_policy']}; modelled",
             f"KV pool per GPU: {out['kv_pool']['num_blocks']:,} blocks of {w['block_size']} "
             f"({out['kv_pool']['source'].replace('_', ' ')}"
             + (f" {_pool_words(out)}" if out['kv_pool']['source'] == 'gpu_memory_utilization'
                else "") + ")",
             f"{'policy':<26}{'TTFT p50':>9}{'p99':>9}{'TPOT p50':>10}{'p99':>8}"
             f"{'tok/s':>9}{'goodput':>9}  ({slo}; ms, req/s)"]
    for p in out["policies"]:
        lat = p["latency"]
        name = p["policy"] + (f" + budget {p['chunk']}" if p["chunk"] else "")
        lines.append(f"{name:<26}{lat['ttft_s']['p50'] * 1e3:9.1f}{lat['ttft_s']['p99'] * 1e3:9.1f}"
                     f"{lat['tpot_s']['p50'] * 1e3:10.2f}{lat['tpot_s']['p99'] * 1e3:8.2f}"
                     f"{p['throughput_tokens_per_s']:9.0f}"
                     f"{p['goodput']['requests_per_s']:9.2f}")
    if w["enable_prefix_caching"]:
        lines.append("prefix cache hit rate: " + ", ".join(
            f"{p['policy']}{' + budget' if p['chunk'] else ''} "
            f"{p['prefix_cache']['hit_rate']:.1%}" for p in out["policies"])
            + f" (system prompt of {w['shared_prefix']} tokens)")
    return "\n".join(lines)


def _pool_words(out):
    """'0.9 of 85.5 GB = 77.0 GB - weights 16.1 - activations 0.21 GB': the pool line's."""
    k = out["kv_pool"]
    return (f"{k['gpu_memory_utilization']:g} of {k['memory_bytes'] / 1e9:.1f} GB = "
            f"{k['budget_bytes'] / 1e9:.1f} GB - weights {k['weights_bytes'] / 1e9:.1f} - "
            f"activations {k['activation_bytes'] / 1e9:.2f} GB")
