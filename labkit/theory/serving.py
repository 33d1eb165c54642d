"""Serving a model, modelled: KV cache, weights at low precision, prefill vs decode on the
roofline, and time to first token (TTFT) and time per output token (TPOT) per layout.

- KV cache per token = layers x 2 (k and v) x kv_heads x head_dim x bytes (GQA/MQA: kv_heads <
  heads; Ainslie et al. 2023, arXiv 2305.13245). A tensor-parallel group splits it by KV heads
  (a head is replicated once tp > kv_heads), a pipeline by layers.
- Weights: the layers' matrices at `weights` precision, plus one bf16 scale per group of
  weights (int4: groups of 128 as GPTQ/AWQ, Frantar et al. 2022, Lin et al. 2023; int8: one
  per output channel, as LLM.int8(); fp8: one per tensor); embeddings, head and norms in bf16.
  fp8 runs fp8 x fp8 GEMMs (W8A8); weight-only formats compute in bf16 (weights dequantised on
  the fly). Linear layers run at the in-step GEMM fraction (pricing.linear_layer_rate).
- Roofline (Williams et al. 2009; Pope et al. 2022, arXiv 2211.05102) with kernels
  (theory/kernels.py): a stage takes max(compute, bytes / achievable HBM bandwidth) + launches,
  compute the sum of its kernels' FLOPs each at peak x MAMF ceiling x its shape efficiency
  (tile and wave quantization), launches kernels.LAUNCH_S per kernel (11 per Llama layer,
  10 per GPT layer): what makes batch-1 decode slower than its bytes alone. Decode reads
  every weight and the whole cache for b tokens: intensity ~ 2b / bytes_per_weight FLOP/byte,
  so it is memory-bound until the knee batch
      b* = (peak x ceiling / achievable bandwidth) x bytes_per_weight / 2.
  Serving counts each kernel's forward only (no backward, no dropout); the training planner
  shares the same kernels (kernels.layer_kernels) with their backward. A stage's pass is
  priced by pricing.serving_pass, the one function the request-stream simulator
  (serving_stream.modelled_step_s) calls too, so both time the same step alike.
- Layouts of one replica (tp x pp x ep GPUs); replicas split the requests, a replica serving
  ceil(b / replicas) of them (at least one: a request is never split across replicas):
  TP: 2 all-reduces per layer of b x h values per decode step (Megatron-LM), each the faster
  of the alpha-beta ring (2(n-1) latencies) and a one-shot all-reduce for small messages
  (small_all_reduce_time);
  PP: the requests in M = pp micro-batches; a token passes every stage and hands off between
  them (pp hops a token, the last back to the first with the sampled token), so
  TPOT = max(M x t_stage, pp x (t_stage + hop)): one GPU's latency plus the hops, pp x the
  memory: PP divides memory, not latency;
  EP: experts / ep per GPU, attention replicated with the requests split over the ep GPUs
  (ceil(b / ep) on the busiest), 2 all-to-alls per layer of its tokens x k x h values (GShard,
  arXiv 2006.16668); the busiest GPU reads min(its experts, the experts the group's tokens
  pick): with few tokens they may all sit on one GPU (the worst case a step waits for).
- Host: a stack that replays CUDA graphs hides the host; one that enqueues kernel by kernel
  (`execution="enqueue"`, `plan --serve --enforce-eager`) takes max(GPU, kernels x
  pricing.ENQUEUE_S) a step, so a short prefill or a batch-1 decode becomes host-bound.
- TTFT: the prefill of the replica's batch (through the pipeline: (M + pp - 1) stage times).
  TPOT: averaged over the generated tokens (context P + T/2).

Constants: none fitted. Kernels as theory/kernels.py (data/kernels.csv, each with its public
source) but two declared fits (the in-step GEMM fraction and ENQUEUE_S, each on its own
calibration rows); links x their modelled efficiency (data/hardware.csv); ACTIVATION_FACTOR is
an assumption (below). Left out: paged-cache fragmentation, continuous batching, speculative
decoding, a CUDA graph's shorter gaps between kernels (launch_s prices every kernel alike).
"""
from __future__ import annotations

import math

from . import catalog, hardware, kernels, plan_inputs as inputs, pricing
from .plan_terms import ep_all_to_all_bytes
from .planner import RESERVED_BYTES, achievable_fraction, parse_model
from .time import collective_time
from .weights import SCALE_BYTES, SCALE_GROUP, WEIGHTS, layer_param_split, weight_bytes  # noqa

ACTIVATION_FACTOR = 4                        # transient (b, s, h)-sized bf16 buffers in flight
                                             # in one layer (input, norm, attention out, residual)
ONE_SHOT_LATENCIES = 2   # a one-shot all-reduce: write to every peer, wait on their flags


def small_all_reduce_time(nbytes, n, link) -> float:
    """A decode step's all-reduce (a few KB): the faster of the ring (time.collective_time:
    2(n-1) link latencies, 28 us on 8 NVLink 4 GPUs) and a one-shot all-reduce, in which each
    GPU writes its S bytes to every peer and sums what it receives: ONE_SHOT_LATENCIES link
    latencies + (n-1) S / bandwidth (about 4 us on 8 H100s). Serving stacks run one for small
    messages (vLLM's and TensorRT-LLM's custom all-reduce, NCCL's LL protocols and NVLS);
    nccl-tests measure 2.3 us for 8 bytes on 8 H200 / H800 (NVIDIA/nccl issue 1940) and about
    6 us on 2 H100s with NVLS (NVIDIA/nccl issue 1259), against 33.7 us for the ring on 8 A100s
    (NVIDIA/nccl-tests issue 123)."""
    if n <= 1:
        return 0.0
    ln = hardware.link(link)
    one_shot = ONE_SHOT_LATENCIES * ln.latency + (n - 1) * nbytes / ln.effective_bandwidth
    return min(one_shot, collective_time("all_reduce", nbytes, n, link))


# ----------------------------------------------------------------------------- bytes

def kv_bytes_per_token(model, kv_dtype="bf16") -> float:
    """KV-cache bytes one token adds: layers x 2 x kv_heads x head_dim x bytes."""
    return pricing.kv_bytes_per_token(parse_model(model), kv_dtype)


def kv_cache_bytes(model, batch, context, kv_dtype="bf16", tp=1, pp=1) -> float:
    """KV cache on one GPU for `batch` sequences of `context` tokens (split by heads over
    min(tp, kv_heads) and by layers over pp)."""
    m = parse_model(model)
    return batch * context * kv_bytes_per_token(m, kv_dtype) / (min(tp, m.kv_heads) * pp)


def cached_kv_bytes(*, layers, requests, prompt_len, new_tokens, hidden, tp=1,
                    bytes_per_value=4) -> float:
    """KV cache a rank holds after greedy generation (labkit's tiny GPT, kv_heads = heads):
    2 x its layers x its requests x cached tokens (P + T - 1: the last token is never fed
    back) x hidden / tp x bytes."""
    return 2 * layers * requests * (prompt_len + new_tokens - 1) * (hidden // tp) * bytes_per_value


def weights_per_gpu(model, weights="bf16", tp=1, pp=1, ep=1) -> float:
    """A GPU's share: dense parts / (tp x pp), experts / (tp x pp x ep)."""
    dense, experts = weight_split_per_gpu(model, weights, tp, pp, ep)
    return dense + experts


def weight_split_per_gpu(model, weights="bf16", tp=1, pp=1, ep=1):
    """(dense bytes, expert bytes) on one GPU: the experts' matrices at the precision with
    their scales, everything else (attention, embeddings, head, norms, routers) dense."""
    return pricing.weight_split(parse_model(model), weights, tp, pp, ep)


# ----------------------------------------------------------------------- the roofline

def decode_intensity(model, batch, context=0, weights="bf16", kv_dtype="bf16") -> float:
    """FLOP per byte of one decode step of `batch` tokens (weights + cache read once)."""
    m = parse_model(model)
    flops = batch * (2 * m.active_param_count() + 4 * m.layers * m.hidden * context)
    read = weight_bytes(m, weights)["total"] + kv_cache_bytes(m, batch, context, kv_dtype)
    return flops / read


def ridge_intensity(gpu="H100") -> float:
    """FLOP per byte where a GPU turns compute-bound: peak x its MAMF ceiling / achievable HBM
    bandwidth (kernels.py)."""
    g = hardware.gpu(gpu)
    return g.bf16_flops * achievable_fraction(g) / kernels.hbm_bandwidth(g)


def knee_batch(model, gpu="H100", weights="bf16", context=0, kv_dtype="bf16") -> float:
    """Smallest decode batch at which a step is compute-bound (inf if the cache never lets
    it: each sequence's cache is read for that sequence only)."""
    ridge = ridge_intensity(gpu)
    lo, hi = 1, 1
    while decode_intensity(model, hi, context, weights, kv_dtype) < ridge:
        hi *= 2
        if hi > 2 ** 24:
            return math.inf
    while lo < hi:
        mid = (lo + hi) // 2
        if decode_intensity(model, mid, context, weights, kv_dtype) >= ridge:
            hi = mid
        else:
            lo = mid + 1
    return lo


# -------------------------------------------------------------- one layout, modelled

def serving_time(model, *, gpu="H100", tp=1, pp=1, ep=1, replicas=1, batch=1, prompt_len=1024,
                 new_tokens=128, weights="bf16", kv_dtype="bf16", gpus_per_node=8,
                 intra_link=None, inter_link=None, microbatches=None, execution="graph",
                 enqueue_s=None) -> dict:
    """TTFT, TPOT and throughput of `batch` requests on `replicas` copies of a tp x pp x ep
    layout; every number modelled (see the module docstring). `execution`: "graph" (the
    stack replays CUDA graphs) or "enqueue" (kernel by kernel: pricing.step_total)."""
    m = parse_model(model)
    g = hardware.gpu(gpu)
    intra = hardware.link(intra_link or g.link)
    inter = hardware.link(inter_link or "InfiniBand NDR")
    if m.experts <= 1 and ep > 1:
        raise ValueError("ep > 1 needs a mixture-of-experts model")
    b_rep = -(-batch // replicas)             # requests per replica: whole ones, at least 1
    b_gpu = -(-b_rep // ep)                   # on the busiest GPU of an EP group
    M = microbatches or (max(1, min(pp, b_rep)) if pp > 1 else 1)
    group_mb = -(-b_rep // M)                 # requests of one micro-batch in the EP group
    b_mb = -(-group_mb // ep)                 # of them on the busiest GPU
    tp_link = intra if tp <= gpus_per_node else inter
    ep_link = intra if tp * ep <= gpus_per_node else inter
    pp_link = intra if tp * ep * pp <= gpus_per_node else inter
    layers = m.layers / pp

    def stage_time(requests, context, new):
        """One micro-batch of `requests` x `new` tokens through one stage: the pass as
        pricing.serving_pass prices it (the one path every serving caller takes) + comm."""
        tokens = requests * new
        # tokens of the whole EP group reach the experts
        part = pricing.serving_pass(m, g, [(new, context)] * requests, tp=tp, pp=pp, ep=ep,
                                    weights=weights, kv_dtype=kv_dtype, routed=group_mb * new,
                                    execution=execution, enqueue_s=enqueue_s)
        compute, memory, launch = part["compute"], part["memory"], part["launch"]
        act = tokens * m.hidden * 2
        tp_comm = 2 * layers * small_all_reduce_time(act, tp, tp_link) if tp > 1 else 0
        # dispatch and combine (no backward): the planner's payload, the same bytes
        ep_comm = (2 * layers * collective_time("all_to_all", ep_all_to_all_bytes(m, tokens),
                                                ep, ep_link) if ep > 1 else 0.0)
        gpu_s = max(compute, memory) + launch + tp_comm + ep_comm
        comm_kernels = 2 * layers * ((tp > 1) + (ep > 1))      # one kernel per collective
        host = pricing.host_time(part["kernels"] + comm_kernels, execution, enqueue_s)
        return dict(compute=compute, memory=memory, launch=launch, tp_comm=tp_comm,
                    ep_comm=ep_comm, host=host, total=max(gpu_s, host),
                    hop=collective_time("send", act, 2, pp_link) if pp > 1 else 0.0)

    pre = stage_time(b_mb, 0, prompt_len)
    ttft = (M + pp - 1) * pre["total"] + pp * pre["hop"] * (pp > 1)
    decode = stage_time(b_mb, prompt_len + new_tokens / 2, 1)
    tpot = max(M * decode["total"], pp * (decode["total"] + decode["hop"]))
    # a token's critical path: its pp stages and hops, or the M micro-batches on one stage
    passes, hops = (pp, pp * decode["hop"]) if pp * (decode["total"] + decode["hop"]) >= \
        M * decode["total"] else (M, 0.0)
    total_s = ttft + (new_tokens - 1) * tpot
    gpus = tp * pp * ep * replicas
    tokens_per_s = batch * new_tokens / total_s
    return dict(tp=tp, pp=pp, ep=ep, replicas=replicas, gpus=gpus, microbatches=M,
                ttft_s=ttft, tpot_s=tpot, tokens_per_s=tokens_per_s,
                tokens_per_s_per_gpu=tokens_per_s / gpus,
                decode_bound="compute" if decode["compute"] >= decode["memory"] else "memory",
                decode_breakdown_s=dict({k: decode[k] * passes for k in (
                    "compute", "memory", "launch", "tp_comm", "ep_comm")}, pp_hops=hops),
                memory_bytes=memory_per_gpu(m, tp=tp, pp=pp, ep=ep, batch_per_gpu=b_gpu,
                                            context=prompt_len + new_tokens,
                                            prompt_len=prompt_len / M, weights=weights,
                                            kv_dtype=kv_dtype))


def tiny_gpt_serving_time(*, layers, hidden, heads, ffn, vocab, seq, experts=0, top_k=1,
                          cluster="8xH100-NVLink", **layout) -> dict:
    """`serving_time` of labkit's tiny GPT (the MoE as the nearest catalog layout, SwiGLU
    experts) on a modelled cluster, bf16 there; `layout`: serving_time's tp, pp, ep,
    replicas, batch, prompt_len, new_tokens."""
    shape = catalog.ModelShape(
        name="tiny-gpt", display_name="labkit tiny GPT", arch="mixtral" if experts else "gpt2",
        layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn, vocab=vocab,
        experts=max(experts, 1), top_k=top_k, tied_embeddings=False, max_seq=seq)
    cl = hardware.cluster(cluster)
    return serving_time(shape, gpu=cl.gpu.name, gpus_per_node=cl.gpus_per_node,
                        intra_link=cl.intra.name, inter_link=cl.inter.name if cl.inter else None,
                        **layout)


def memory_per_gpu(model, *, tp=1, pp=1, ep=1, batch_per_gpu=1, context=4096, prompt_len=None,
                   weights="bf16", kv_dtype="bf16") -> dict:
    """{weights, kv_cache, activations, total} bytes on one GPU (worst case: full context).
    activations: ACTIVATION_FACTOR (b, s, h) bf16 buffers of the prefill chunk, the MLP's
    (b, s, ffn/tp) and the last position's fp32 logits."""
    m = parse_model(model)
    s = prompt_len or context
    w = weights_per_gpu(m, weights, tp, pp, ep)
    kv = kv_cache_bytes(m, batch_per_gpu, context, kv_dtype, tp, pp)
    act = batch_per_gpu * s * (ACTIVATION_FACTOR * m.hidden + 2 * m.ffn / tp) * 2 \
        + batch_per_gpu * m.vocab * 4
    return dict(weights=w, kv_cache=kv, activations=act, total=w + kv + act)


# ------------------------------------------------------------------- the serving planner

FIX_FIELDS = ("tp", "pp", "ep", "replicas")


def parse_serve_fix(text):
    """'tp=8,pp=2' -> {field: int}; the serving plan's layout fields only."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in FIX_FIELDS:
            raise ValueError(f"--fix: unknown field {key!r}; use {', '.join(FIX_FIELDS)}")
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--fix: {key} must be a positive integer, got {value.strip()!r}")
        out[key] = int(value)
    return out


def why_not(m, gpus, plan, batch):
    """'' if a serving layout is legal, else why not."""
    tp, pp, ep, replicas = (plan[k] for k in FIX_FIELDS)
    if gpus % (tp * pp * ep):
        return f"tp*pp*ep = {tp * pp * ep} does not divide the {gpus} GPUs"
    if tp * pp * ep * replicas != gpus:
        return f"tp*pp*ep*replicas = {tp * pp * ep * replicas}, not the {gpus} GPUs"
    if m.heads % tp or (m.kv_heads % tp and tp % m.kv_heads):
        return f"tp={tp} does not split {m.heads} heads / {m.kv_heads} kv heads"
    if pp > m.layers:
        return f"pp={pp} > {m.layers} layers"
    if ep > 1 and (m.experts <= 1 or m.experts % ep):
        return f"ep={ep} must divide the experts ({m.experts})"
    return ""


def plan_serving(model, gpus, gpu="H100", *, prompt_len=1024, new_tokens=128, batch=1,
                 weights=None, kv_dtype="bf16", max_tpot_ms=None, fix=None, gpus_per_node=8,
                 intra_link=None, inter_link=None, top=None, execution="graph") -> dict:
    """Every TP x PP x EP x replicas x weight precision layout, modelled; plans that fit and
    meet the TPOT bound first, by output tokens/s per GPU; then the slow ones, then those that
    do not fit (each with its reason). `execution`: "graph" or "enqueue" (serving_time)."""
    m = parse_model(model)
    g = hardware.gpu(gpu)
    for name, value in dict(gpus=gpus, prompt_len=prompt_len, new_tokens=new_tokens,
                            batch=batch, gpus_per_node=gpus_per_node).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got "
                             f"{value!r}")
    inputs.count("gpus", gpus)                  # bounded like the training planner's
    inputs.count("gpus_per_node", gpus_per_node)
    fix = parse_serve_fix(fix) if isinstance(fix, str) else dict(fix or {})
    precisions = [weights] if weights else list(WEIGHTS)
    for w in precisions:
        if w not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {w!r}")
    usable = g.memory_bytes - RESERVED_BYTES
    divisors = inputs.divisors(gpus)           # from the factorisation: 1e9 GPUs at once
    plans, reasons = [], set()
    for tp in [fix["tp"]] if "tp" in fix else [d for d in divisors if d <= m.heads]:
        for pp in [fix["pp"]] if "pp" in fix else [d for d in divisors if d <= m.layers]:
            for ep in [fix["ep"]] if "ep" in fix else [d for d in divisors
                                                       if m.experts > 1 and m.experts % d == 0
                                                       or d == 1]:
                replicas = fix.get("replicas", gpus // (tp * pp * ep))
                layout = dict(tp=tp, pp=pp, ep=ep, replicas=replicas)
                why = why_not(m, gpus, layout, batch)
                if why:
                    reasons.add(why)
                    continue
                for w in precisions:
                    plans.append(_serve_plan(m, g, layout, w, kv_dtype, batch, prompt_len,
                                             new_tokens, usable, max_tpot_ms, gpus_per_node,
                                             intra_link, inter_link, execution))
    if not plans:
        raise ValueError(f"no legal serving layout for {m.display_name} on {gpus} {g.name}"
                         + (f" with {fix}" if fix else "") + ": "
                         + "; ".join(sorted(reasons)[:3]))
    plans.sort(key=lambda p: (not p["fits"], bool(p["reason"]), -p["tokens_per_s_per_gpu"]))
    return dict(model=dict(name=m.name, display_name=m.display_name, params=m.param_count(),
                           active_params=m.active_param_count()),
                cluster=dict(gpu=g.name, gpus=gpus, gpus_per_node=gpus_per_node,
                             usable_bytes=usable, achievable=achievable_fraction(g)),
                workload=dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                              kv_dtype=kv_dtype, max_tpot_ms=max_tpot_ms, execution=execution),
                considered=len(plans), plans=plans[:top] if top else plans)


def _serve_plan(m, g, layout, w, kv_dtype, batch, prompt_len, new_tokens, usable, max_tpot_ms,
                gpus_per_node, intra_link, inter_link, execution):
    t = serving_time(m, gpu=g, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                     weights=w, kv_dtype=kv_dtype, gpus_per_node=gpus_per_node,
                     intra_link=intra_link, inter_link=inter_link, execution=execution,
                     **layout)
    mem = t["memory_bytes"]
    fits = mem["total"] <= usable
    reason = ""
    if not fits:
        big = max(("weights", "kv_cache", "activations"), key=lambda k: mem[k])
        reason = (f"needs {mem['total'] / 1e9:.1f} GB per GPU > {usable / 1e9:.1f} GB usable "
                  f"(mostly {big.replace('_', ' ')}: {mem[big] / 1e9:.1f} GB)")
    elif max_tpot_ms is not None and t["tpot_s"] * 1e3 > max_tpot_ms:
        reason = f"TPOT {t['tpot_s'] * 1e3:.1f} ms > {max_tpot_ms:g} ms"
    return dict(layout, weights=w, kv_dtype=kv_dtype, batch_per_replica=-(-batch // layout[
        "replicas"]), fits=fits, reason=reason, memory_bytes=mem, ttft_s=t["ttft_s"],
        tpot_s=t["tpot_s"], tokens_per_s=t["tokens_per_s"],
        tokens_per_s_per_gpu=t["tokens_per_s_per_gpu"], decode_bound=t["decode_bound"])


def format_serving_plans(out):
    """The serving ranking as text (what `plan --serve` prints); every time is modelled."""
    c, m, w = out["cluster"], out["model"], out["workload"]
    lines = [f"{m['display_name']} ({m['params'] / 1e9:.1f}B params) served on {c['gpus']} x "
             f"{c['gpu']}: batch {w['batch']}, prompt {w['prompt_len']}, {w['new_tokens']} new "
             f"tokens, KV {w['kv_dtype']}"
             + ("; no CUDA graphs (the host enqueues every kernel)"
                if w.get("execution") == "enqueue" else "")
             + f"; {out['considered']} layouts, modelled",
             f"{'tp':>3} {'pp':>3} {'ep':>3} {'repl':>4} {'weights':>7} {'GB/GPU':>7} "
             f"{'TTFT ms':>8} {'TPOT ms':>8} {'tok/s':>9} {'tok/s/GPU':>9}  ok"]
    for p in out["plans"]:
        lines.append(
            f"{p['tp']:>3} {p['pp']:>3} {p['ep']:>3} {p['replicas']:>4} {p['weights']:>7} "
            f"{p['memory_bytes']['total'] / 1e9:7.1f} {p['ttft_s'] * 1e3:8.1f} "
            f"{p['tpot_s'] * 1e3:8.2f} {p['tokens_per_s']:9.0f} "
            f"{p['tokens_per_s_per_gpu']:9.0f}  {p['reason'] or 'yes'}")
    return "\n".join(lines)
