"""`python -m labkit calibrate`: measure this machine's GPU and write a hardware profile.

What the planners take from a datasheet, measured here with CUDA events after warm-up (the
median of several repetitions; a short kernel repeated back to back to fill each timed
window, so that Python's launch latency is not timed with it):
  - bf16 GEMM TFLOP/s (2 m n k FLOPs per product) over square shapes 1024..8192 and the skinny
    ones decode (m = 1..256 tokens) and tensor parallelism (hidden / tp) produce;
  - HBM bandwidth: one large device-to-device copy, read + write bytes counted (2 x size);
  - one decode step and one training step of a random bf16 Llama-shaped model (RMSNorm, SwiGLU,
    causal attention; rotary embeddings left out: elementwise, a rounding error in time);
  - the NCCL all-reduce curve on every GPU of the machine (only with 2 or more).
The profile format and its use in `plan --gpu-profile`: labkit/theory/profile.py. Each
measured number is printed beside the lab's own model of it (theory/serving.py's decode
roofline, theory/transformer.py's 6N + 12Lhs FLOPs at the MAMF ceiling, theory/kernels.py).
"""
from __future__ import annotations

import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from .theory import plan_cluster, serving, transformer
from .theory.error_band import LLAMA_1B, model_shape
from .theory.profile import catalog_gpu, check_profile, peak_tflops
from .runtime.atomic import write_json

# LLAMA_1B: the measured model's shape (theory/error_band.py keeps it: its check rows model the
# same shape); the quick run keeps the same shape, fewer repetitions.
WINDOW_S = 1e-3     # each timed window: long enough that launch latency is a rounding error
SQUARES = (1024, 2048, 4096, 8192)
TOKENS = (1, 16, 64, 256)                          # decode batches / short prefill chunks
SKINNY_NK = ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (3584, 8192))


def no_gpu_reason():
    """None when a CUDA GPU is usable here, else why not (one line)."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU here (torch {torch.__version__}, cuda {torch.version.cuda})"
    return None


def calls_per_window(seconds, window_s=WINDOW_S, most=1000):
    """How many back-to-back calls of a `seconds`-long function fill one timed window."""
    return max(1, min(most, math.ceil(window_s / max(seconds, 1e-9))))


def cuda_seconds(fn, warmup=3, reps=10):
    """Median seconds of one fn() on the current CUDA stream, timed with CUDA events. The GPU
    idles while Python launches the first kernel after `start`, so one short kernel between two
    events would time that launch latency (tens of microseconds) too: short functions run
    calls_per_window() times back to back between the events, and the window is divided."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    calls = calls_per_window(_window_seconds(fn, 1))      # a sizing window, not kept
    return statistics.median(_window_seconds(fn, calls) for _ in range(reps))


def _window_seconds(fn, calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def gemm_shapes(quick=False):
    squares = [(s, s, s) for s in (SQUARES[::2] + (8192,) if quick else SQUARES)]
    tokens = (1, 64, 256) if quick else TOKENS
    nk = SKINNY_NK[:3] if quick else SKINNY_NK
    return squares + [(m, n, k) for m in tokens for n, k in nk]


def measure_gemm(shapes, device="cuda", dtype=torch.bfloat16, reps=10):
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = cuda_seconds(lambda: torch.mm(a, b), reps=reps)
        rows.append(dict(m=m, n=n, k=k, dtype="bf16", tflops=2 * m * n * k / seconds / 1e12))
    return rows


def measure_hbm(device="cuda", nbytes=2 * 2**30, reps=10):
    """GB/s of a device-to-device copy of `nbytes`, counting read + write (2 x nbytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = cuda_seconds(lambda: dst.copy_(src), reps=reps)
    return 2 * nbytes / seconds / 1e9


# ------------------------------------------------------------------ a Llama-shaped model

class LlamaBlock(nn.Module):
    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cache=None):
        """x: (b, s, h). cache (decode): (k, v) of (b, heads, context + 1, d); the new token's
        k, v go to the last slot, in place (as a serving engine's preallocated cache)."""
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        if cache is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:   # the new token sees the cached context and itself
            cache[0][:, :, -s:].copy_(k)
            cache[1][:, :, -s:].copy_(v)
            a = F.scaled_dot_product_attention(q, cache[0], cache[1])
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, layers, hidden, heads, ffn, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaBlock(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx, caches=None):
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.norm(x))


def measure_decode(shape, batch, context, device="cuda", reps=10, model=None):
    """(seconds replayed as one CUDA graph or None if capture failed, seconds run eagerly).
    Eager decode of a small model waits on Python launching ~250 kernels; the graph shows
    what the GPU itself needs, which is what the roofline models."""
    model = model or Llama(**shape).to(device, torch.bfloat16).eval()
    d = shape["hidden"] // shape["heads"]
    caches = [tuple(torch.randn(batch, shape["heads"], context + 1, d, device=device,
                                dtype=torch.bfloat16) for _ in range(2))
              for _ in range(shape["layers"])]
    idx = torch.randint(shape["vocab"], (batch, 1), device=device)
    with torch.no_grad():
        eager = cuda_seconds(lambda: model(idx, caches), reps=reps)
        try:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):   # warm-up off the capture stream, as PyTorch asks
                for _ in range(3):
                    model(idx, caches)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                model(idx, caches)
            return cuda_seconds(graph.replay, reps=reps), eager
        except Exception as error:   # noqa: BLE001 - eager timing still stands
            print(f"calibrate: CUDA graph capture failed ({type(error).__name__}); eager only",
                  flush=True)
            return None, eager


def decode_row(shape, batch, context, device, reps, model):
    graph, eager = measure_decode(shape, batch, context, device, reps, model)
    return dict(model="llama-1b-shaped", batch=batch, context=context,
                seconds=graph or eager, mode="cuda graph" if graph else "eager",
                eager_seconds=eager)


def measure_train(shape, batch, seq, device="cuda", reps=5, model=None):
    """Forward, backward and an AdamW step of the bf16 model (bf16 weights and states)."""
    model = model or Llama(**shape).to(device, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    idx = torch.randint(shape["vocab"], (batch, seq + 1), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(idx[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten()).backward()
        optimizer.step()
    return cuda_seconds(step, warmup=2, reps=reps)


def _all_reduce_rank(ctx, sizes, reps):
    out = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=ctx.device)
        seconds = cuda_seconds(lambda: torch.distributed.all_reduce(t), warmup=2, reps=reps)
        out.append(dict(bytes=nbytes, seconds=seconds))
    return out


def measure_all_reduce(gpus, quick=False):
    """The all-reduce curve on `gpus` NCCL ranks (rank 0's medians); [] with fewer than 2."""
    if gpus < 2:
        return []
    from .runtime.launch import launch
    sizes = [2**p for p in range(10, 31, 4 if quick else 2)]
    return launch(_all_reduce_rank, gpus, sizes, 5 if quick else 10, backend="nccl",
                  timeout_s=300)[0]


# -------------------------------------------------------------------- modelled, side by side

def modelled(profile_gpu_name, shape, decode_rows, train_rows):
    """The lab's model of each step on the catalog GPU named like this one (None: no match):
    {("decode"|"train", batch, context|seq): seconds}."""
    g = catalog_gpu(profile_gpu_name)
    if g is None:
        return {}
    m = model_shape(shape)
    out = {}
    for r in decode_rows:
        t = serving.serving_time(m, gpu=g, batch=r["batch"], prompt_len=r["context"],
                                 new_tokens=1)
        out[("decode", r["batch"], r["context"])] = t["tpot_s"]
    rate = g.bf16_flops * plan_cluster.achievable_fraction(g)
    for r in train_rows:
        flops = transformer.model_flops_per_token(m, r["seq"]) * r["batch"] * r["seq"]
        out[("train", r["batch"], r["seq"])] = flops / rate
    return out


def calibrate(quick=False, progress=print):
    """Measure this GPU; returns the profile (theory/profile.py's format)."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    say = lambda text: progress(f"calibrate: {text}", flush=True)   # noqa: E731
    profile = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__,
                   cuda=torch.version.cuda)
    say(f"{profile['gpu']}, torch {profile['torch']}, cuda {profile['cuda']}: GEMMs")
    profile["gemm"] = measure_gemm(gemm_shapes(quick), device, reps=5 if quick else 10)
    say(f"best large bf16 GEMM {peak_tflops(profile):.0f} TFLOP/s; HBM copy")
    profile["hbm_gbps"] = measure_hbm(device, reps=5 if quick else 10)
    say(f"HBM {profile['hbm_gbps']:.0f} GB/s (read + write); decode steps")
    model = Llama(**LLAMA_1B).to(device, torch.bfloat16)
    profile["decode_step_s"] = [
        decode_row(LLAMA_1B, b, c, device, 5 if quick else 20, model)
        for b, c in (((1, 1024), (64, 1024)) if quick else ((1, 1024), (16, 2048), (64, 1024),
                                                             (256, 1024)))]
    say("training steps")
    model.train()
    profile["train_step_s"] = [
        dict(model="llama-1b-shaped", batch=b, seq=s,
             seconds=measure_train(LLAMA_1B, b, s, device, reps=3 if quick else 5, model=model))
        for b, s in (((4, 2048),) if quick else ((4, 2048), (8, 2048)))]
    del model
    torch.cuda.empty_cache()
    gpus = torch.cuda.device_count()
    say(f"all-reduce on {gpus} GPU(s)" if gpus > 1 else
        "all-reduce: skipped, 1 GPU (the curve needs 2 or more)")
    profile["all_reduce"] = measure_all_reduce(gpus, quick)
    return check_profile(profile)


def side_by_side(profile):
    """Measured beside modelled, as text lines (modelled: the catalog GPU's datasheet)."""
    g = catalog_gpu(profile["gpu"])
    lines = [f"{profile['gpu']} (catalog: {g.name if g else 'no match, nothing modelled'})"]
    if g:
        lines.append(f"  best large bf16 GEMM {peak_tflops(profile):7.1f} TFLOP/s measured | "
                     f"{g.bf16_flops / 1e12:7.1f} datasheet peak | "
                     f"{(g.mamf_bf16_flops or math.nan) / 1e12:7.1f} public MAMF")
        lines.append(f"  HBM {profile['hbm_gbps']:8.0f} GB/s measured (copy, read + write) | "
                     f"{g.memory_bw / 1e9:8.0f} datasheet")
    model = modelled(profile["gpu"], LLAMA_1B, profile["decode_step_s"],
                     profile["train_step_s"])
    for kind, rows, key in (("decode", profile["decode_step_s"], "context"),
                            ("train", profile["train_step_s"], "seq")):
        for r in rows:
            m = model.get((kind, r["batch"], r[key]))
            ratio = f"{r['seconds'] / m:5.2f}x" if m else "  n/a"
            how = f" ({r['mode']}; eager {r['eager_seconds'] * 1e3:.3f} ms)" \
                if "mode" in r else ""
            lines.append(f"  {kind:6} {r['model']} batch {r['batch']:>3} {key} {r[key]:>5}: "
                         f"{r['seconds'] * 1e3:9.3f} ms measured{how} | "
                         + (f"{m * 1e3:9.3f} ms modelled | measured/modelled {ratio}"
                            if m else "not modelled"))
    for r in profile["all_reduce"]:
        lines.append(f"  all_reduce {r['bytes']:>12,} B: {r['seconds'] * 1e6:10.1f} us, "
                     f"{r['bytes'] / r['seconds'] / 1e9:7.1f} GB/s algorithm bandwidth")
    return lines


def calibrate_command(out=None, quick=False):
    """The CLI: 1 (one line, no traceback) without a GPU, else measure, print, write."""
    if out:   # before minutes of measuring: a folder, a missing folder, a read-only place
        from .cli_output import check_writable
        check_writable(out, "--out")
    reason = no_gpu_reason()
    if reason:
        print(f"calibrate: {reason}; it measures a CUDA GPU, nothing to do", file=sys.stderr)
        return 1
    start = time.perf_counter()
    profile = calibrate(quick=quick)
    for line in side_by_side(profile):
        print(line, flush=True)
    if out:
        write_json(out, profile, indent=1)   # atomic: a failed write keeps the old profile
        print(f"calibrate: profile written to {out} ({time.perf_counter() - start:.0f} s)")
    return 0
