"""The planner: which DP x TP x PP (x CP, EP) layouts of a model fit a cluster, and how fast.

For a model, a cluster and a global batch it enumerates every legal plan (dp, tp, pp, cp, ep,
interleave v, micro-batch size, ZeRO stage 0-3, recompute none/selective/full, sequence
parallel), predicts memory per GPU (worst pipeline stage) and the step time, and ranks the plans
that fit. Everything is modelled from first principles with named constants:

- Compute: FLOPs (transformer.py) at `achievable` x peak (one constant per GPU kind, calibrated
  on Narayanan et al. 2021 Table 1, data/published_runs.csv; see `calibrate`).
- Memory, Megatron-LM's convention: bf16 weights (2 B/param), fp32 main gradients (4), fp32
  master weights + Adam moments (12); ZeRO-1 shards the 12 over DP, ZeRO-2 also the gradients,
  ZeRO-3 also the weights (plus two gathered layers in flight). Activations per layer from
  transformer.py times the micro-batches a stage holds at once: 1F1B holds pp on the first
  stage, interleaving (v chunks) ((v+1)pp - 1) chunks of L/(pp v) layers (Megatron-LM's warm-up).
- Time: compute + recompute + TP collectives (4 all-reduces per layer and micro-batch, 6 with
  full recompute; exposed) + CP's ring of K/V shards beyond what attention hides (Liu et al.
  2023, arXiv 2310.01889) + pipeline bubble (pp-1)/v micro-batch times (Narayanan et al. 2021)
  + pipeline sends + DP gradient reduction overlapped with the last micro-batch's backward except
  one bucket + ZeRO-3 weight gathers not hidden under compute + the optimizer (memory bound).
  Collectives use the alpha-beta ring model (time.py) on NVLink inside a node, the inter-node
  link (one NIC per GPU) across nodes; a group is inside a node when its ranks span <= 8.

Left out (so errors can be read): kernel launch and Python overheads, imperfect overlap,
load imbalance between MoE experts, the embedding's all-reduce across the first and last stage,
network contention between concurrent groups, stragglers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import catalog, hardware, transformer as tf
from .time import collective_time

# Bytes per parameter (weights, gradients, optimizer state) with Adam. bf16: Megatron-LM's
# mixed precision (bf16 weights, fp32 main grads, fp32 master + moments); fp32: plain fp32 Adam.
STATE_BYTES = {"bf16": (2, 4, 12), "fp32": (4, 4, 8)}
RESERVED_BYTES = 2 * 2**30     # CUDA context, cuBLAS/NCCL workspaces, allocator fragmentation
BUCKET_BYTES = 40e6 * 4        # Megatron-LM's default DDP bucket: 40M fp32 gradients
ADAM_BYTES_TOUCHED = 30        # read grad, master, m, v (16 B); write master, m, v, bf16 (14 B)
# The two fitted constants (calibrate() on Narayanan et al. 2021 Table 1, A100 80GB, Megatron-LM;
# mean absolute error 1.4%, every row within 4%). ACHIEVABLE: large bf16 GEMMs reach ~68% of the
# A100's 312 TFLOP/s (cuBLAS reaches 70-80% on big square GEMMs; transformer shapes are less
# regular). HBM_PASSES: element-wise kernels read and write each activation byte a layer keeps
# ~7 times over forward and backward (unfused norms, GELU, softmax, dropout and residuals each
# read their input and write their output). GPUs without their own `achievable` inherit it.
ACHIEVABLE = 0.68
HBM_PASSES = 7.25
MICRO_BATCHES = (1, 2, 4, 8, 16)
VIRTUAL = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
FIELDS = ("dp", "tp", "pp", "cp", "ep", "v", "micro_batch_size", "zero_stage", "recompute",
          "sequence_parallel")
SHAPE_KEYS = ("layers", "hidden", "heads", "ffn", "vocab", "kv_heads", "experts", "top_k",
              "tied", "arch", "seq")


@dataclass(frozen=True)
class ClusterSpec:
    gpu: hardware.GPU
    gpus: int
    gpus_per_node: int = 8
    intra: hardware.Link = None
    inter: hardware.Link = None
    achievable: float = ACHIEVABLE   # fraction of peak bf16 FLOP/s large matmuls reach
    hbm_passes: float = HBM_PASSES   # HBM reads+writes per activation byte kept, fwd+bwd
    flash_attention: bool = True     # the software stack: FlashAttention (no s^2 softmax kept)
    precision: str = "bf16"          # "bf16": mixed precision (Megatron); "fp32": all fp32
    dropout: bool = None             # None: GPT models have dropout, Llama models do not

    def link(self, span):
        """The link of a group whose members lie within `span` consecutive ranks."""
        return self.intra if span <= self.gpus_per_node else self.inter

    @property
    def usable_bytes(self):
        return self.gpu.memory_bytes - RESERVED_BYTES


def make_cluster(gpu="H100", gpus=8, gpus_per_node=8, intra_link=None, inter_link=None,
                 achievable=None, hbm_passes=None, flash_attention=True, precision="bf16",
                 dropout=None):
    g = hardware.gpu(gpu)
    if gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"GPU counts must be positive: gpus={gpus}, per node={gpus_per_node}")
    intra = hardware.link(intra_link or g.link)
    inter = hardware.link(inter_link or "InfiniBand NDR")
    return ClusterSpec(g, gpus, gpus_per_node, intra, inter,
                       achievable or achievable_fraction(g),
                       HBM_PASSES if hbm_passes is None else hbm_passes, flash_attention,
                       precision, dropout)


def achievable_fraction(gpu):
    """Fraction of dense bf16 peak large transformer matmuls reach (data/hardware.csv column
    `achievable`, fitted on A100 by `calibrate`; other GPUs inherit it unless a row says)."""
    value = getattr(gpu, "achievable", None)
    return value if value else ACHIEVABLE


def parse_model(text):
    """A catalog name, a ModelShape, or 'layers=..,hidden=..,heads=..,ffn=..,vocab=..[,...]'.

    A shape string is a Llama-family model (SwiGLU, RMSNorm) unless ffn == 4*hidden with no
    kv_heads, or arch=gpt is given: then it is a GPT (GELU MLP, tied embeddings, 2048 positions).
    """
    if isinstance(text, catalog.ModelShape):
        return text
    if "=" not in str(text):
        return catalog.model(text)
    fields = {}
    for part in str(text).split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in SHAPE_KEYS:
            raise ValueError(f"unknown shape field {key!r}; use {', '.join(SHAPE_KEYS)}")
        fields[key] = value.strip()
    missing = [k for k in ("layers", "hidden", "heads", "ffn", "vocab") if k not in fields]
    if missing:
        raise ValueError(f"shape needs {', '.join(missing)} (e.g. layers=48,hidden=6144,"
                         "heads=64,ffn=24576,vocab=51200)")
    num = {k: int(v) for k, v in fields.items() if k not in ("tied", "arch")}
    if any(v < 1 for v in num.values()):
        raise ValueError(f"shape fields must be positive integers: {text}")
    gpt = fields.get("arch") == "gpt" or (
        "arch" not in fields and num["ffn"] == 4 * num["hidden"] and "kv_heads" not in num)
    tied = fields.get("tied", "true" if gpt else "false").lower() in ("true", "1", "yes")
    return catalog.ModelShape(
        name="custom", display_name=str(text), arch="gpt2" if gpt else "llama",
        layers=num["layers"], hidden=num["hidden"], heads=num["heads"],
        kv_heads=num.get("kv_heads", num["heads"]), ffn=num["ffn"], vocab=num["vocab"],
        experts=num.get("experts", 1), top_k=num.get("top_k", 1), tied_embeddings=tied,
        max_seq=num.get("seq", 2048))


def why_illegal(m, c, batch, seq, p):
    """'' if plan `p` is a legal layout of model `m` on cluster `c`, else the reason."""
    dp, tp, pp, cp, ep, v, mbs = (p[k] for k in ("dp", "tp", "pp", "cp", "ep", "v",
                                                 "micro_batch_size"))
    if dp * tp * pp * cp != c.gpus:
        return f"dp*tp*pp*cp = {dp * tp * pp * cp}, not the {c.gpus} GPUs"
    if m.heads % tp or (m.kv_heads % tp and tp % m.kv_heads):
        return f"tp={tp} does not split {m.heads} heads / {m.kv_heads} kv heads"
    if m.ffn % tp:
        return f"tp={tp} does not divide ffn={m.ffn}"
    if pp > m.layers:
        return f"pp={pp} > {m.layers} layers"
    if v > 1 and (pp == 1 or math.ceil(m.layers / pp) % v):
        return f"v={v} needs pp > 1 and layers per stage divisible by v"
    if batch % (dp * mbs):
        return f"global batch {batch} does not split into dp={dp} x micro-batch {mbs}"
    if v > 1 and (batch // (dp * mbs)) % pp:
        return "interleaving needs micro-batches divisible by pp"
    if p["zero_stage"] >= 2 and pp > 1:
        return "ZeRO-2/3 with pipeline parallelism (Megatron-LM and DeepSpeed refuse it)"
    if p["sequence_parallel"] and tp == 1:
        return "sequence parallelism needs tp > 1"
    if cp > 1 and seq % (2 * cp):
        return f"sequence {seq} does not split into 2*cp={2 * cp} chunks"
    if m.experts > 1 and (m.experts % ep or dp % ep):
        return f"ep={ep} must divide experts={m.experts} and dp={dp}"
    if m.experts <= 1 and ep > 1:
        return "ep > 1 needs a mixture-of-experts model"
    return ""


def evaluate(m, c, batch, seq, p):
    """Memory per GPU and modelled step time of one legal plan (the DESIGN.md plan dict)."""
    dp, tp, pp, cp, ep, v = (p[k] for k in ("dp", "tp", "pp", "cp", "ep", "v"))
    mbs, zero, rc, sp = p["micro_batch_size"], p["zero_stage"], p["recompute"], \
        p["sequence_parallel"]
    micro = batch // (dp * mbs)
    layers = math.ceil(m.layers / pp)
    cl = tf.layer_counts(m)
    # Experts are spread over ep ranks (and TP-split like the dense MLP).
    layer_params = cl.attention / tp + cl.mlp_total / (tp * ep) + cl.router + cl.norms
    embedding, head = tf.embedding_params(m) / tp, tf.head_params(m) / tp
    if pp == 1:
        stage_params = layers * layer_params + embedding + (0 if m.tied_embeddings else head)
    else:          # the worse of the first stage (embedding) and the last (head, or its copy)
        stage_params = layers * layer_params + max(embedding, head)
    # --- memory (bytes per GPU, the worst stage)
    shard = dp * cp       # ZeRO shards over every rank holding the same weights
    weight_b, grad_b, optim_b = STATE_BYTES[c.precision]
    params = weight_b * stage_params / (shard if zero >= 3 else 1)
    grads = grad_b * stage_params / (shard if zero >= 2 else 1)
    optimizer = optim_b * stage_params / (shard if zero >= 1 else 1)
    flash, act = c.flash_attention, dict(dropout=c.dropout, value_bytes=weight_b)
    per_layer_act = tf.activation_bytes(m, seq, mbs, tp, sp, rc, cp, flash, **act)
    in_flight = min(micro, pp) * layers if v == 1 else \
        min(micro * v, (v + 1) * pp - 1) * layers / v
    activations = per_layer_act * in_flight
    if rc == "full":
        activations += tf.full_layer_activation_bytes(m, seq, mbs, tp, sp, cp, flash, **act)
    last_stage_logits = tf.logits_bytes(m, seq, mbs, tp, cp)
    activations = max(activations, per_layer_act * layers + last_stage_logits) if pp > 1 \
        else activations + last_stage_logits
    buffers = 2 * weight_b * layer_params if zero == 3 else 0.0
    total = params + grads + optimizer + activations + buffers
    # --- time (seconds per step on the slowest stage)
    flops_rate = c.gpu.bf16_flops * c.achievable
    tokens_mb = mbs * seq / cp
    fwd = tokens_mb * layers * tf.layer_forward_flops_per_token(m, seq) / tp
    head = tokens_mb * tf.head_flops_per_token(m) / tp
    compute_mb = 3 * fwd + head
    core = tokens_mb * layers * tf.attention_core_flops_per_token(m, seq) / tp
    # FlashAttention recomputes the scores in backward: selective recompute comes built in.
    extra = {"none": core if flash else 0.0, "selective": core, "full": fwd}[rc]
    act_bytes = 2 * tokens_mb * m.hidden
    ar_per_layer = 6 if rc == "full" else 4
    tp_mb = layers * ar_per_layer * collective_time("all_reduce", act_bytes, tp, c.link(tp))
    # Memory-bound element-wise work (norms, activations, softmax, dropout, residuals): HBM
    # passes over the bytes a layer keeps for backward, again for recomputed forwards.
    elementwise = c.hbm_passes * layers * tf.activation_bytes(m, seq, mbs, tp, sp, "none", cp,
                                                              flash, **act) \
        / c.gpu.memory_bw * {"none": 1.0, "selective": 1.0, "full": 4 / 3}[rc]
    # CP: K and V shards travel the ring (cp - 1 hops forward; K, V and their gradients again
    # backward: 3 x), each hop hidden under one block of attention unless the link is slower.
    cp_mb = 0.0
    if cp > 1:
        kv_bytes = 2 * 2 * tokens_mb * m.kv_heads * m.head_dim / tp
        hop = collective_time("send", kv_bytes, 2, c.link(cp * tp))
        block = 3 * tokens_mb * tf.attention_core_flops_per_token(m, seq) / tp / cp / flops_rate
        cp_mb = layers * 3 * (cp - 1) * max(0.0, hop - block / 3)
    mb_time = (compute_mb + extra) / flops_rate + tp_mb + cp_mb + elementwise
    bubble = (pp - 1) / v * mb_time
    send = collective_time("send", act_bytes / tp, 2, c.link(dp * cp * tp * 2)) if pp > 1 else 0
    pp_comm = 2 * micro * v * send
    grad_bytes = grad_b * stage_params   # fp32 (expert grads really reduce over dp/ep ranks only)
    dp_link = c.link(dp * cp * tp)
    if zero == 0:
        dp_total = collective_time("all_reduce", grad_bytes, shard, dp_link)
    else:      # reduce-scatter fp32 grads, all-gather bf16 weights
        dp_total = (collective_time("reduce_scatter", grad_bytes, shard, dp_link)
                    + collective_time("all_gather", grad_bytes / 2 / shard, shard, dp_link))
    bucket = dp_total * min(1.0, BUCKET_BYTES / max(grad_bytes, 1))
    backward_window = 2 * fwd / flops_rate
    dp_comm = max(bucket, dp_total - backward_window)
    if zero == 3:       # gather every layer before forward and backward, hidden under compute
        gathers = 2 * collective_time("all_gather", 2 * stage_params / shard, shard, dp_link)
        dp_comm += micro * max(0.0, gathers - compute_mb / flops_rate)
    opt_params = stage_params / (shard if zero >= 1 else 1)
    optimizer_s = ADAM_BYTES_TOUCHED * opt_params / c.gpu.memory_bw
    breakdown = dict(compute=micro * (compute_mb / flops_rate + elementwise),
                     recompute=micro * extra / flops_rate,
                     tp_comm=micro * tp_mb, cp_comm=micro * cp_mb, pp_bubble=bubble,
                     pp_comm=pp_comm, dp_comm=dp_comm,
                     optimizer=optimizer_s)
    step = sum(breakdown.values())
    gpus = c.gpus
    model_flops = batch * seq * tf.model_flops_per_token(m, seq)
    per_token = {"none": tf.attention_core_flops_per_token(m, seq) if flash else 0.0,
                 "selective": tf.attention_core_flops_per_token(m, seq),
                 "full": tf.layer_forward_flops_per_token(m, seq)}[rc]
    hw_flops = model_flops + batch * seq * m.layers * per_token
    fits = total <= c.usable_bytes
    return dict(
        p, microbatches=micro, fits=fits,
        reason="" if fits else (f"needs {total / 1e9:.1f} GB per GPU > "
                                f"{c.usable_bytes / 1e9:.1f} GB usable on {c.gpu.name}"),
        memory_bytes=dict(params=params, grads=grads, optimizer=optimizer,
                          activations=activations, buffers=buffers, total=total),
        step_s=step, breakdown_s=breakdown,
        mfu=model_flops / (step * gpus * c.gpu.bf16_flops),
        hfu=hw_flops / (step * gpus * c.gpu.bf16_flops),
        tokens_per_s_per_gpu=batch * seq / step / gpus,
        model_tflops_per_gpu=model_flops / step / gpus / 1e12)


def _divisors(n, limit=None):
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def candidates(m, c, batch, seq, fix=None):
    """Every plan (dict of FIELDS) the search visits, `fix`ed fields held. Under FlashAttention
    selective recompute is what the kernel already does: the search visits "none" for it."""
    fix = dict(fix or {})
    rcs = ("none", "full") if c.flash_attention else RECOMPUTE
    pow2 = [d for d in _divisors(c.gpus) if d & (d - 1) == 0] or [1]
    long_context = seq >= 32768
    for tp in [fix["tp"]] if "tp" in fix else [d for d in pow2 if d <= m.heads]:
        for cp in [fix["cp"]] if "cp" in fix else ([d for d in pow2 if d <= 32]
                                                   if long_context else [1]):
            for pp in [fix["pp"]] if "pp" in fix else [d for d in _divisors(c.gpus // (tp * cp)
                                                       if c.gpus % (tp * cp) == 0 else 1)
                                                       if d <= m.layers]:
                dp = fix.get("dp", c.gpus // (tp * cp * pp))
                eps = [fix["ep"]] if "ep" in fix else (
                    [e for e in _divisors(m.experts) if dp % e == 0] if m.experts > 1 else [1])
                for ep in eps:
                    for v in [fix["v"]] if "v" in fix else (VIRTUAL if pp > 1 else (1,)):
                        for mbs in [fix["micro_batch_size"]] if "micro_batch_size" in fix \
                                else MICRO_BATCHES:
                            for zero in [fix["zero_stage"]] if "zero_stage" in fix else \
                                    ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                                for rc in [fix["recompute"]] if "recompute" in fix else rcs:
                                    for sp in [fix["sequence_parallel"]] if \
                                            "sequence_parallel" in fix else \
                                            ((False, True) if tp > 1 else (False,)):
                                        yield dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, v=v,
                                                   micro_batch_size=mbs, zero_stage=zero,
                                                   recompute=rc, sequence_parallel=sp)


def parse_fix(text):
    """'dp=64,tp=8,recompute=full,sequence_parallel=true' -> {field: value}."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key not in FIELDS:
            raise ValueError(f"--fix: unknown field {key!r}; use {', '.join(FIELDS)}")
        if key == "recompute":
            if value not in RECOMPUTE:
                raise ValueError(f"--fix: recompute must be one of {RECOMPUTE}")
            out[key] = value
        elif key == "sequence_parallel":
            out[key] = value.lower() in ("true", "1", "yes")
        else:
            out[key] = int(value)
            if out[key] < 0 or (out[key] == 0 and key != "zero_stage"):
                raise ValueError(f"--fix: {key} must be positive, got {value}")
    return out


def plan(model, gpus, gpu="H100", gpus_per_node=8, intra_link=None, inter_link=None,
         global_batch=None, global_batch_tokens=None, seq=4096, fix=None, top=None,
         achievable=None, hbm_passes=None, flash_attention=True, precision="bf16",
         dropout=None):
    """Rank every legal plan; returns DESIGN.md's {"model", "cluster", "considered", "plans"}.

    flash_attention=False models a stack that stores the softmax (Megatron-LM in 2021);
    precision="fp32" an all-fp32 run (4 + 4 + 8 bytes of Adam states per parameter)."""
    m = parse_model(model)
    c = make_cluster(gpu, gpus, gpus_per_node, intra_link, inter_link, achievable, hbm_passes,
                     flash_attention, precision, dropout)
    if seq < 1:
        raise ValueError(f"sequence length must be positive, got {seq}")
    if global_batch is None:
        if not global_batch_tokens:
            raise ValueError("give the global batch in sequences or in tokens")
        global_batch = max(1, round(global_batch_tokens / seq))
    if global_batch < 1:
        raise ValueError(f"global batch must be positive, got {global_batch}")
    fix = parse_fix(fix) if isinstance(fix, str) else dict(fix or {})
    legal, reasons = [], set()
    for p in candidates(m, c, global_batch, seq, fix):
        why = why_illegal(m, c, global_batch, seq, p)
        if why:
            reasons.add(why)
            continue
        legal.append(evaluate(m, c, global_batch, seq, p))
    if not legal:
        raise ValueError(f"no legal plan for {m.display_name} on {gpus} {c.gpu.name}"
                         + (f" with {fix}" if fix else "") + ": " + "; ".join(sorted(reasons)[:3]))
    legal.sort(key=lambda r: (not r["fits"], r["step_s"] if r["fits"]
                              else r["memory_bytes"]["total"]))
    return dict(model=dict(name=m.name, display_name=m.display_name,
                           params=m.param_count(), active_params=m.active_param_count()),
                cluster=dict(gpu=c.gpu.name, gpus=gpus, gpus_per_node=gpus_per_node,
                             intra_link=c.intra.name, inter_link=c.inter.name,
                             achievable=c.achievable, usable_bytes=c.usable_bytes),
                workload=dict(global_batch=global_batch, seq=seq),
                considered=len(legal), plans=legal[:top] if top else legal)


def published_check(rows, achievable=None, hbm_passes=None):
    """Predicted vs published TFLOP/s per GPU for rows of data/published_runs.csv, each with
    the layout fields the row gives held fixed (the rest searched); adds `predicted`, `error`
    (relative) and the `plan`. `metric` says whether the row counts recompute (hfu) or not."""
    out = []
    for r in rows:
        fix = {k: r[k] for k in FIELDS if str(r.get(k, "")).strip() != ""}
        fix = parse_fix(",".join(f"{k}={v}" for k, v in fix.items()))
        best = plan(r["model"], int(r["gpus"]), r["gpu"], int(r["gpus_per_node"]),
                    r["intra_link"], r["inter_link"], global_batch=int(r["global_batch"]),
                    seq=int(r["seq"]), fix=fix, top=1, achievable=achievable,
                    hbm_passes=hbm_passes,
                    flash_attention=r["attention"] == "flash")["plans"][0]
        peak = hardware.gpu(r["gpu"]).bf16_flops
        predicted = best["hfu" if r["metric"] == "hfu" else "mfu"] * peak / 1e12
        out.append(dict(r, predicted=predicted, plan=best,
                        error=predicted / float(r["tflops_per_gpu"]) - 1))
    return out


def published_runs(source=None):
    """Rows of data/published_runs.csv (optionally only those whose `use` is `source`)."""
    import csv
    with open(hardware.DATA_DIR / "published_runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if source in (None, r["use"])]


def calibrate(rows, achievable=(0.40, 0.90, 0.01), hbm_passes=(0.0, 12.0, 0.5)):
    """The (achievable fraction, HBM passes) pair on a grid that minimises the mean absolute
    percentage error on `rows`: the planner's only two fitted constants."""
    best = None
    for a in _grid(*achievable):
        for h in _grid(*hbm_passes):
            mape = sum(abs(r["error"]) for r in published_check(rows, a, h)) / len(rows)
            if best is None or mape < best[2]:
                best = (a, h, mape)
    return dict(achievable=best[0], hbm_passes=best[1], mape=best[2])


def _grid(lo, hi, step):
    return [round(lo + i * step, 6) for i in range(int(round((hi - lo) / step)) + 1)]


def format_plans(out):
    """The ranking as text (what `python -m labkit plan` prints); all times are modelled."""
    c, m = out["cluster"], out["model"]
    lines = [f"{m['display_name']} ({m['params'] / 1e9:.1f}B params) on {c['gpus']} x "
             f"{c['gpu']} ({c['gpus_per_node']} per node, {c['intra_link']} / "
             f"{c['inter_link']}), batch {out['workload']['global_batch']} x "
             f"{out['workload']['seq']} tokens: {out['considered']} legal plans, modelled",
             f"{'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>3} {'v':>2} {'mbs':>3} "
             f"{'ZeRO':>4} {'recompute':>9} {'sp':>3} {'GB/GPU':>7} {'step s':>8} {'MFU':>6} "
             f"{'tok/s/GPU':>9}  fits"]
    for p in out["plans"]:
        lines.append(
            f"{p['dp']:>5} {p['tp']:>3} {p['pp']:>3} {p['cp']:>3} {p['ep']:>3} {p['v']:>2} "
            f"{p['micro_batch_size']:>3} {p['zero_stage']:>4} {p['recompute']:>9} "
            f"{'yes' if p['sequence_parallel'] else 'no':>3} "
            f"{p['memory_bytes']['total'] / 1e9:7.1f} {p['step_s']:8.3f} {p['mfu']:6.1%} "
            f"{p['tokens_per_s_per_gpu']:9.0f}  {'yes' if p['fits'] else p['reason']}")
    return "\n".join(lines)
