"""Serving a request stream on ranks: static or continuous batching, a contiguous or paged KV
cache, whole or chunked prefill; every request's tokens checked against it served alone.

`python -m labkit run serve --requests 32 --rate 40 --policy continuous [--paged
--block-size 8] [--max-num-batched-tokens 16 [--no-enable-chunked-prefill]] [--max-num-seqs 8]
[--enable-prefix-caching --shared-prefix 16] [--scheduling-policy priority]
[--num-gpu-blocks-override N | --gpu-memory-utilization 0.9 --time-model llama-3-8b]
[--temperature 0.8 --top-p 0.9 --seed 1] [--tp 2 | --replicas 2] [--json]` (vLLM's flag
names; `--max-batch` and `--chunk` are the old names of max_num_seqs and
max_num_batched_tokens). The KV pool per rank: --num-gpu-blocks-override blocks, or the blocks
the modelled GPU of --time-model holds at --gpu-memory-utilization (theory/stream_sim.kv_pool;
only the blocks the stream can ever hold are allocated, which schedules alike), or
--kv-tokens slots (default max_num_seqs x the longest request). Sampling: each request draws
with --temperature and --top-p from a generator seeded by --seed and its id, and is checked
against itself served alone with the same seed. Requests (Poisson arrivals,
seeded, or `--trace FILE`) are served by `labkit.parallel.batching.Engine`: with --replicas
each rank serves the requests whose id % replicas is its own, with --tp every rank of the
group runs the same scheduler on a model split by `parallelize_module` (heads and MLP columns; each
rank's cache holds its heads). The report: requests[{id, prompt, output, arrival_s,
token_times, ttft_s, tpot_s, e2e_s}]; metrics, what `vllm bench serve` prints under its names
(theory/serving_metrics.py: duration from the start, TTFT, TPOT over requests of more than one
token, ITL, E2EL as mean / median / std / p50 / p90 / p99, request, output-token and
total-token throughput, request_goodput under --ttft-ms / --tpot-ms); the same in seconds as
latency{ttft_s, tpot_s, itl_s, e2e_s -> {mean, median, std, p50, p99}}, requests_per_s,
throughput_tokens_per_s, total_tokens_per_s, request_goodput and slo{ttft_ms, tpot_ms,
attainment}; prefix_cache{queries, hits, hit_rate, prefill_tokens_saved, evictions} (measured,
under --enable-prefix-caching); tokens_differing (against each request's greedy tokens
generated alone on one device: must be 0), batch_logit_gap (the largest |logit| difference of
the next token between a request alone and all of them in one ragged pass: 0 would be batch
invariance),
kv_blocks{used, total, wasted_bytes, ...} (peak
blocks, mean bytes reserved but unused over the steps; measured) and the peak requests running.
All latencies are measured wall seconds on these CPU ranks.
"""
import time
from functools import partial
from dataclasses import dataclass, field, asdict

import torch

from .. import models
from ..parallel.batching import Engine, Request, synced_clock
from ..parallel.paged_kv import PagedKVCache, SamplingParams, batch_logit_gap, ragged_forward
from ..parallel.serving import generate
from ..parallel.parallel_styles import parallelize_module
from ..parallel.tensor_parallel_plan import gpt_plan
from ..theory import catalog, hardware, serving_stream as theory, stream_sim
from ..runtime.cpus import available_memory
from . import serve_fit, stream_inputs
from .preflight import _gb
from .serve import BYTES, TIMEOUT_S, ServeConfig, gpt_shape, timed_launch, tokens_differing


@dataclass
class StreamConfig:
    """A stream and how it is served."""
    requests: int = 16
    rate: float = 50.0                 # requests per second (Poisson)
    prompt_len: tuple = (8, 32)        # inclusive ranges
    output_len: tuple = (4, 16)
    trace: str | None = None           # a CSV/JSON trace instead of the Poisson stream
    policy: str = "continuous"
    max_num_seqs: int = 8              # most requests running at once (vLLM's name)
    paged: bool = False
    block_size: int = 8
    kv_tokens: int | None = None       # token slots of KV per rank (default: max_num_seqs x seq)
    max_num_batched_tokens: int | None = None   # tokens per step, decodes + prompt (None: no cap)
    enable_chunked_prefill: bool = True         # cut prompts to the budget (else whole)
    enable_prefix_caching: bool = False         # vLLM v1's automatic prefix caching (--paged)
    scheduling_policy: str = "fcfs"             # or "priority" (a trace's priority column)
    num_gpu_blocks_override: int | None = None  # KV blocks per rank (vLLM's name)
    gpu_memory_utilization: float | None = None  # of the --time-model GPU: its pool's blocks
    temperature: float = 0.0                    # vLLM's SamplingParams (0: greedy)
    top_p: float = 1.0
    shared_prefix: int = 0             # tokens of a system prompt every prompt begins with
    tp: int = 1
    replicas: int = 1
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    time_model: str | None = None      # a catalog model: latencies modelled for it on time_gpu
    time_gpu: str = "H100"
    seed: int = 0
    model_kwargs: dict = field(default_factory=dict)

    @property
    def world_size(self):
        return self.tp * self.replicas

    def stream(self):
        if self.trace:
            return stream_inputs.read_trace(self.trace)   # every row checked
        return theory.poisson_stream(self.requests, self.rate, self.prompt_len,
                                     self.output_len, self.seed)

    def gpt_config(self, stream=None):
        stream = self.stream() if stream is None else stream
        return gpt_shape(self.model_kwargs, max(r["prompt"] + r["output"] for r in stream))

    def as_dict(self):
        return asdict(self)

    def sampling(self, rid):
        """Request rid's SamplingParams: greedy, or its own generator from the seed and id."""
        if self.temperature == 0:
            return SamplingParams()
        return SamplingParams(self.temperature, self.top_p, 1_000_003 * self.seed + rid)

    def pool(self, gpt, stream):
        """(blocks, block size, where the count comes from, blocks allocated): the KV pool of
        one rank. A pool larger than every request of the stream at once schedules as that
        many blocks (nothing is preempted or evicted), so no more are allocated."""
        block = self.block_size if self.paged else gpt.seq
        if self.num_gpu_blocks_override is not None:
            blocks, source = self.num_gpu_blocks_override, "num_gpu_blocks_override"
        elif self.gpu_memory_utilization is not None:
            blocks = stream_sim.kv_pool(
                self.time_model, self.time_gpu, gpu_memory_utilization=self.gpu_memory_utilization,
                block_size=block, profile_tokens=self.max_num_batched_tokens or max(
                    r["prompt"] + r["output"] for r in stream) * self.max_num_seqs,
                max_num_seqs=self.max_num_seqs)["num_blocks"]
            source = (f"gpu_memory_utilization {self.gpu_memory_utilization:g} of one "
                      f"{self.time_gpu} for {self.time_model}")
        else:
            slots = self.kv_tokens or self.max_num_seqs * gpt.seq
            return slots // block, block, "--kv-tokens" if self.kv_tokens else "default", \
                slots // block
        need = sum(1 if not self.paged else -(-(r["prompt"] + r["output"]) // block)
                   for r in stream)
        return blocks, block, source, min(blocks, need)


def check_config(cfg):
    """Everything checkable before ranks start, one line each."""
    for name in ("tp", "replicas", "max_num_seqs", "block_size"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer")
    stream_sim.check_scheduling_policy(cfg.scheduling_policy)
    SamplingParams(cfg.temperature, cfg.top_p)       # one line for a bad temperature or top-p
    if cfg.num_gpu_blocks_override is not None and (cfg.kv_tokens is not None or
                                                    cfg.gpu_memory_utilization is not None):
        raise ValueError("--num-gpu-blocks-override gives the KV pool's blocks: drop "
                         "--kv-tokens and --gpu-memory-utilization")
    if cfg.num_gpu_blocks_override is not None and cfg.num_gpu_blocks_override < 1:
        raise ValueError(f"--num-gpu-blocks-override must be a positive number of blocks, got "
                         f"{cfg.num_gpu_blocks_override}")
    if cfg.gpu_memory_utilization is not None and (cfg.kv_tokens is not None or
                                                   not cfg.time_model):
        raise ValueError("--gpu-memory-utilization sizes the KV pool of a modelled GPU: give "
                         "--time-model MODEL (and --time-gpu), without --kv-tokens; on these "
                         "CPU ranks give --num-gpu-blocks-override or --kv-tokens instead")
    if cfg.enable_prefix_caching and not cfg.paged:
        raise ValueError("--enable-prefix-caching caches full blocks of a paged KV cache: give "
                         "--paged too")
    if isinstance(cfg.shared_prefix, bool) or not isinstance(cfg.shared_prefix, int) or \
            cfg.shared_prefix < 0:
        raise ValueError(f"shared_prefix must be a whole number of tokens >= 0, got "
                         f"{cfg.shared_prefix!r}")
    budget = cfg.max_num_batched_tokens
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or
                               budget < cfg.max_num_seqs):
        raise ValueError(f"--max-num-batched-tokens must be an integer >= --max-num-seqs "
                         f"({cfg.max_num_seqs}): each running request's decode must fit a "
                         f"step, got {budget!r}")
    stream_sim.check_budget(cfg.max_num_seqs, budget, cfg.enable_chunked_prefill)
    if cfg.kv_tokens is not None and cfg.kv_tokens < 1:
        raise ValueError(f"--kv-tokens must be a positive integer, got {cfg.kv_tokens}")
    stream_inputs.check_limits(cfg.ttft_ms, cfg.tpot_ms, *((None, None) if cfg.trace
                                                          else (cfg.rate, cfg.requests)))
    if not cfg.trace:
        stream_inputs.check_ranges(tuple(cfg.prompt_len), tuple(cfg.output_len))
    if cfg.time_model:
        step_time(cfg)          # names an unknown model or GPU before ranks start
    stream = cfg.stream()       # checks --requests, --rate and the lengths, or each trace row
    source = f"--trace {cfg.trace}" if cfg.trace else f"--requests {cfg.requests} --rate " \
        f"{cfg.rate:g}"
    stream_inputs.check_arrivals(stream, cfg.time_model is not None, source)
    c = cfg.gpt_config(stream)
    if c.heads % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} must divide the {c.heads} heads")
    check_pool(cfg, c, stream)
    for r in stream:
        stream_sim.check_fits_budget(r["id"], r["prompt"], r["output"],
                                     cfg.max_num_batched_tokens, cfg.enable_chunked_prefill)
    check_fits(cfg, c, stream)


def check_fits(cfg, gpt, stream, timeout_s=TIMEOUT_S, available=None):
    """Refuse, in one line, a stream whose ranks cannot hold their KV pool and model here, or
    whose largest request alone cannot be served within the ranks' timeout (a lower bound:
    runs/serve_fit.py's, for that one request on this layout)."""
    largest = max(stream, key=lambda r: (r["prompt"] + r["output"], r["prompt"]))
    alone = ServeConfig(tp=cfg.tp, batch=1, prompt_len=largest["prompt"],
                        new_tokens=largest["output"], model_kwargs=dict(cfg.model_kwargs,
                                                                        seq=gpt.seq))
    what = (f"request {largest['id']} (prompt {largest['prompt']:,} + output "
            f"{largest['output']:,} tokens; the GPT then has {gpt.seq:,} positions)")
    available = available_memory() if available is None else available
    if available is not None:
        bound = serve_fit.memory(alone)
        _, block, _, allocated = cfg.pool(gpt, stream)
        slots = allocated * block + gpt.seq                                 # the pool + scratch
        pool = 2 * gpt.layers * slots * (gpt.hidden // cfg.tp) * BYTES
        need = cfg.world_size * (bound["per_rank"] - bound["parts"]["kv_cache"] + pool)
        if max(need, bound["reference"]) > available:
            raise ValueError(f"the stream needs about {_gb(max(need, bound['reference']))} but "
                             f"{_gb(available)} is available ({cfg.world_size} rank(s), each a "
                             f"KV pool of {slots:,} token slots, for {what}): shorter requests, "
                             "a smaller --max-num-seqs or --kv-tokens")
    est = serve_fit.seconds(alone)["seconds"]
    if est > timeout_s:
        raise ValueError(f"{what} alone would take at least {est:,.0f} s here, more than the "
                         f"ranks' {timeout_s} s limit: give shorter requests or a smaller shape")


def check_pool(cfg, gpt, stream):
    """The KV pool the ranks will build (make_cache) holds at least one block and the largest
    request whole: else a rank would raise, or the request wait for blocks forever."""
    blocks, block, source, _ = cfg.pool(gpt, stream)
    slots = blocks * block if source not in ("default", "--kv-tokens") else \
        cfg.kv_tokens or cfg.max_num_seqs * gpt.seq
    flag = f"--kv-tokens {slots}" if source == "--kv-tokens" else \
        f"the pool of --max-num-seqs {cfg.max_num_seqs} x {gpt.seq} positions ({slots:,} " \
        "slots)" if source == "default" else f"{blocks:,} blocks ({source})"
    if block > slots:
        what = f"--block-size {cfg.block_size}" if cfg.paged else \
            f"one request's maximum length ({gpt.seq} slots, the contiguous cache's block)"
        raise ValueError(f"{what} is larger than {flag}: the pool would hold no block")
    pool = slots // block * block
    largest = max(stream, key=lambda r: r["prompt"] + r["output"])
    need = largest["prompt"] + largest["output"]
    if need > pool:
        raise ValueError(f"request {largest['id']} (prompt {largest['prompt']} + output "
                         f"{largest['output']} = {need} tokens) is larger than the whole KV "
                         f"cache: {flag} makes {pool:,} token slots in blocks of {block}")


def step_time(cfg):
    """The modelled step time of cfg.time_model on one cfg.time_gpu (None: wall clock)."""
    if not cfg.time_model:
        return None
    return partial(theory.modelled_step_s, catalog.model(cfg.time_model),
                   hardware.gpu(cfg.time_gpu))


def latency_source(cfg):
    if cfg.time_model:
        return (f"modelled: {cfg.time_model} on one {cfg.time_gpu} (roofline per step); the "
                "tokens computed here by the tiny GPT")
    return "measured: wall seconds on CPU ranks"


def build_model(cfg, stream):
    """The served GPT (the same seed on every rank and in the reference), in eval mode."""
    return models.build("gpt", seed=cfg.seed, **cfg.gpt_config(stream).as_dict()).eval()


def prompts(cfg, stream):
    """Each request's prompt ids, from the seed and its id (the same on every rank)."""
    vocab = cfg.gpt_config(stream).vocab
    out = {r["id"]: torch.randint(0, vocab, (r["prompt"],), generator=torch.Generator()
                                  .manual_seed(10_000 * (cfg.seed + 1) + r["id"]))
           for r in stream}
    if cfg.shared_prefix:          # one system prompt, as long as each prompt allows
        system = torch.randint(0, vocab, (cfg.shared_prefix,),
                               generator=torch.Generator().manual_seed(cfg.seed))
        for ids in out.values():
            n = min(cfg.shared_prefix, ids.numel())
            ids[:n] = system[:n]
    return out


def make_cache(cfg, gpt, kv_width, stream):
    """The paged cache, or the contiguous one (max length reserved), of cfg.pool's blocks."""
    _, block, _, allocated = cfg.pool(gpt, stream)
    if cfg.paged:
        return PagedKVCache(gpt.layers, kv_width, allocated, block,
                            enable_prefix_caching=cfg.enable_prefix_caching)
    return PagedKVCache.contiguous(gpt.layers, kv_width, gpt.seq, allocated * block)


def serve(ctx, cfg):
    """This rank's share of the stream (replicas) or the whole stream (TP); returns records."""
    stream = cfg.stream()
    gpt = cfg.gpt_config(stream)
    mesh = ctx.mesh(dp=cfg.replicas, tp=cfg.tp)
    model = build_model(cfg, stream)
    if cfg.tp > 1:
        parallelize_module(model, mesh["tp"], gpt_plan(vocab=False))
    dp_rank = mesh.coords["dp"]
    ids = prompts(cfg, stream)
    mine = [_request(cfg, r, ids) for r in stream if r["id"] % cfg.replicas == dp_rank]
    cache = make_cache(cfg, gpt, gpt.hidden // cfg.tp, stream)
    scratch = PagedKVCache(gpt.layers, gpt.hidden // cfg.tp, 1, gpt.seq)   # warm-up, untimed
    scratch.reserve(0, gpt.seq)
    ragged_forward(model, [(0, torch.zeros(gpt.seq, dtype=torch.int64), 0)], scratch)
    clock = synced_clock(mesh["tp"]) if cfg.tp > 1 and not cfg.time_model else time.perf_counter
    engine = Engine(model, cache, cfg.policy, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                    enable_chunked_prefill=cfg.enable_chunked_prefill, clock=clock,
                    on_finish=lambda done, total: ctx.progress(done, total),
                    step_time=step_time(cfg), scheduling_policy=cfg.scheduling_policy)
    done = engine.run(mine)
    return dict(rank=ctx.rank, tp_rank=mesh.coords["tp"], backend=ctx.backend,
                requests=[dict(id=r.id, tokens=r.generated, token_times=r.token_times,
                               preemptions=r.preemptions) for r in done],
                steps=engine.steps, peak_blocks=cache.peak_blocks, preempted=engine.preempted,
                prefix_cache=cache.prefix_stats(),
                bytes_per_slot=cache.bytes_per_slot)


def serve_locally(cfg):
    """The whole stream on this process (one device, no ranks): (records, summary, engine),
    for lessons and explorers; latencies modelled when cfg.time_model is set."""
    check_config(cfg)
    stream = cfg.stream()
    gpt, model = cfg.gpt_config(stream), build_model(cfg, stream)
    ids = prompts(cfg, stream)
    cache = make_cache(cfg, gpt, gpt.hidden, stream)
    engine = Engine(model, cache, cfg.policy, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                    step_time=step_time(cfg), enable_chunked_prefill=cfg.enable_chunked_prefill,
                    scheduling_policy=cfg.scheduling_policy)
    done = {r.id: r for r in engine.run([_request(cfg, r, ids) for r in stream])}
    records = [dict(r, preemptions=done[r["id"]].preemptions, **theory.request_metrics(
        r["arrival_s"], done[r["id"]].token_times, r["output"])) for r in stream]
    gaps = [b - a for q in done.values() for a, b in zip(q.token_times, q.token_times[1:])]
    return records, theory.summarise(records, cfg.ttft_ms, cfg.tpot_ms, gaps), engine


def _request(cfg, row, ids):
    return Request(row["id"], ids[row["id"]], row["output"], row["arrival_s"],
                   sampling=cfg.sampling(row["id"]), priority=row.get("priority", 0))


def reference_tokens(cfg, stream):
    """Each request's tokens generated alone on one device: greedy, lesson 09's generate;
    sampled, the engine serving it alone with its own seed (one request at a time)."""
    model, ids = build_model(cfg, stream), prompts(cfg, stream)
    if cfg.temperature == 0:
        return {r["id"]: generate(model, ids[r["id"]][None], r["output"])[0].tolist()
                for r in stream}
    gpt, out = cfg.gpt_config(stream), {}
    for r in stream:
        alone = Engine(model, PagedKVCache(gpt.layers, gpt.hidden, 1, gpt.seq), "continuous", 1,
                       step_time=lambda pieces: 0.0)
        q = alone.run([_request(cfg, dict(r, arrival_s=0.0), ids)])[0]
        out[r["id"]] = q.generated
    return out


def kv_summary(steps):
    """The cache over a run's steps (measured): blocks, pool bytes, and the bytes and fraction
    of reserved slots holding nothing, averaged over the steps (a shared prefix block's slots
    count once: requests sharing it hold it once)."""
    kv = [s["kv"] for s in steps]
    return dict(used=max(k["used"] for k in kv), total=kv[0]["total"],
                block_size=kv[0]["block_size"], pool_bytes=kv[0]["pool_bytes"],
                wasted_bytes=sum(k["wasted_bytes"] for k in kv) / len(kv),
                wasted_fraction=sum(1 - k["filled_tokens"] / max(1, k["reserved_tokens"])
                                    for k in kv) / len(kv))


def prefix_summary(stats):
    """The replicas' prefix caches together (measured): queries, hits, hit rate, prefill
    tokens saved, evictions."""
    queries, hits = sum(s["queries"] for s in stats), sum(s["hits"] for s in stats)
    return dict(queries=queries, hits=hits, hit_rate=hits / queries if queries else 0.0,
                prefill_tokens_saved=hits, evictions=sum(s["evictions"] for s in stats))


def report(cfg=None, timeout_s=300):
    """Serve the stream on ranks, compare every request with one device, return the report."""
    cfg = cfg or StreamConfig()
    check_config(cfg)
    stream = cfg.stream()
    results, wall = timed_launch(serve, cfg.world_size, cfg, timeout_s=timeout_s)
    leaders = [r for r in results if r["tp_rank"] == 0]     # one per replica
    served = {q["id"]: q for r in leaders for q in r["requests"]}
    ref = reference_tokens(cfg, stream)
    differing = tokens_differing({i: q["tokens"] for i, q in served.items()}, ref)
    ids = prompts(cfg, stream)
    gap = batch_logit_gap(build_model(cfg, stream),
                          [torch.cat([ids[i], torch.tensor(ref[i][:-1], dtype=ids[i].dtype)])
                           for i in sorted(ref)])
    records = [dict(id=r["id"], prompt=r["prompt"], output=r["output"], arrival_s=r["arrival_s"],
                    preemptions=served[r["id"]]["preemptions"],
                    token_times=served[r["id"]]["token_times"],
                    **theory.request_metrics(r["arrival_s"], served[r["id"]]["token_times"],
                                             r["output"]))
               for r in stream]
    steps = [s for r in leaders for s in r["steps"]]
    kv = dict(kv_summary(steps), used=max(r["peak_blocks"] for r in leaders),
              bytes_per_slot=leaders[0]["bytes_per_slot"])
    blocks, block, source, allocated = cfg.pool(cfg.gpt_config(stream), stream)
    gaps = [b - a for q in served.values()
            for a, b in zip(q["token_times"], q["token_times"][1:])]
    summary = theory.summarise(records, cfg.ttft_ms, cfg.tpot_ms, gaps)
    return dict(technique="serve", mode="stream", world_size=cfg.world_size,
                backend=results[0]["backend"], config=cfg.as_dict(), requests=records,
                latency=summary["latency"], metrics=summary["vllm"],
                throughput_tokens_per_s=summary["throughput_tokens_per_s"],
                total_tokens_per_s=summary["total_tokens_per_s"],
                requests_per_s=summary["requests_per_s"],
                request_goodput=summary["request_goodput"],
                slo=dict(ttft_ms=cfg.ttft_ms, tpot_ms=cfg.tpot_ms,
                         attainment=summary["goodput"]["fraction"]),
                duration_s=summary["duration_s"],
                tokens_differing=int(differing), tokens_equal_reference=differing == 0,
                batch_logit_gap=gap,
                kv_blocks=kv, prefix_cache=prefix_summary([r["prefix_cache"] for r in leaders]),
                kv_pool=dict(num_blocks=blocks, block_size=block, source=source,
                             allocated_blocks=allocated),
                scheduling_policy=cfg.scheduling_policy,
                preempted=[i for r in leaders for i in r["preempted"]],
                peak_running=max(s["batch"] for s in steps),
                steps=len(steps), step_tokens_max=max(s["tokens"] for s in steps),
                preemptions=sum(r["preemptions"] for r in records), wall_s=wall,
                latency_source=latency_source(cfg))


def format_report(r):
    """What the CLI prints without --json."""
    c, lat, kv = r["config"], r["latency"], r["kv_blocks"]
    cache = f"paged, blocks of {c['block_size']}" if c["paged"] else "contiguous (max length)"
    lines = [f"stream of {len(r['requests'])} requests, {c['policy']} batching (max "
             f"{c['max_num_seqs']}), {cache}" + (
                 f", max_num_batched_tokens {c['max_num_batched_tokens']} (chunked prefill "
                 f"{'on' if c['enable_chunked_prefill'] else 'off'})"
                 if c["max_num_batched_tokens"] else "")
             + f" on {r['world_size']} rank(s) (tp {c['tp']}, replicas {c['replicas']})",
             f"tokens differing from each request served alone: {r['tokens_differing']}",
             f"largest |logit alone - logit batched| (next tokens, all requests in one pass): "
             f"{r['batch_logit_gap']:.1e} (0 would be batch invariance)",
             f"latency ({r['latency_source']}; as `vllm bench serve` reports it)",
             "  ms                  mean    median       std       p99"]
    for k in [k for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s") if k in lat]:
        row = [lat[k][q] * 1e3 for q in ("mean", "median", "std", "p99")]
        name = "E2EL" if k == "e2e_s" else k[:-2].upper()
        lines.append(f"  {name:<14}" + "".join(f"{v:10.2f}" for v in row))
    g = r["slo"]
    slo = (f"request_goodput {r['request_goodput']:.2f} req/s ({g['attainment']:.0%} within "
           f"TTFT {g['ttft_ms']} ms, TPOT {g['tpot_ms']} ms)"
           if r["request_goodput"] is not None
           else "request_goodput: give an SLO with --ttft-ms / --tpot-ms")
    lines += [f"over {r['duration_s']:.3f} s from the start: {r['requests_per_s']:.2f} req/s, "
              f"{r['throughput_tokens_per_s']:.1f} output tokens/s, "
              f"{r['total_tokens_per_s']:.1f} total tokens/s; {slo}",
              f"KV: peak {kv['used']} of {kv['total']} blocks, mean {kv['wasted_bytes']:.0f} "
              f"bytes reserved but unused ({kv['wasted_fraction']:.0%}); peak "
              f"{r['peak_running']} requests running, {r['preemptions']} preemption(s)"
              + (f" ({c['scheduling_policy']}: requests {', '.join(map(str, r['preempted']))})"
                 if r["preempted"] else ""),
              f"KV pool per rank: {r['kv_pool']['num_blocks']:,} blocks of "
              f"{r['kv_pool']['block_size']} ({r['kv_pool']['source']}; "
              f"{r['kv_pool']['allocated_blocks']:,} allocated)"]
    if c["enable_prefix_caching"]:
        p = r["prefix_cache"]
        lines.append(f"prefix cache: {p['hits']:,} of {p['queries']:,} prompt tokens found "
                     f"cached (hit rate {p['hit_rate']:.1%}), {p['evictions']} evictions")
    return "\n".join(lines)


def config_from_args(args, shape):
    if getattr(args, "pp", 1) > 1 or getattr(args, "experts", 0):
        raise ValueError("--requests serves the dense GPT with --tp and --replicas (not --pp "
                         "or --experts)")
    return StreamConfig(
        requests=args.requests, rate=args.rate, trace=args.trace, policy=args.policy,
        max_num_seqs=args.max_batch, paged=args.paged, block_size=args.block_size,
        kv_tokens=args.kv_tokens, max_num_batched_tokens=args.chunk,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching, tp=args.tp, replicas=args.replicas,
        shared_prefix=args.shared_prefix, scheduling_policy=args.scheduling_policy,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization, temperature=args.temperature,
        top_p=args.top_p,
        prompt_len=tuple(args.stream_prompt_len), output_len=tuple(args.stream_output_len),
        ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, time_model=args.time_model,
        time_gpu=args.time_gpu, seed=args.seed, model_kwargs=shape)
