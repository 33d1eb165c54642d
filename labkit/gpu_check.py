"""`python -m labkit gpu-check` (`make gpu-check`): the lab's GPU path, run once on a real GPU.

Four parts, each check in its own try/except (a failure is one row saying FAIL and why, the
rest still run), all under one time budget (a part not started in time: SKIPPED):
  (a) `calibrate --quick`: GEMM, HBM, decode and training steps (labkit/calibrate.py);
  (b) every building block at world size 1 through `labkit.runtime.launch` (NCCL on the GPU):
      three training steps of the tiny GPT with the block against the same model without it,
      judged by `labkit.numerics` (float32's own error against a float64 run); generation with
      a KV cache against generation without one (tokens equal);
  (c) the CUDA allocator's bytes against the memory tracker's categories for one step;
  (d) measured training and decode step times against the lab's model of them.
One markdown table (check | result | measured | modelled | ratio) is printed and saved with the
profile and every row as JSON. The functions take `device` and `backend`, so that the same
checks run on CPU with gloo (tests/test_gpu_check.py), all but the CUDA timing.
"""
from __future__ import annotations

import copy
import math
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from . import numerics
from .models import GPTConfig, MoEConfig, TinyGPT, build_moe
from .runtime.atomic import write_json, write_text

SMALL = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=2, ffn=64)
BATCH, STEPS, LR = 4, 3, 1e-2


class Budget:
    """Seconds left of a total; `left()` <= 0 means: start nothing more."""

    def __init__(self, seconds):
        self.end = time.perf_counter() + seconds

    def left(self):
        return self.end - time.perf_counter()


def row(check, result, measured="", modelled="", ratio="", note=""):
    return dict(check=check, result=result, measured=measured, modelled=modelled, ratio=ratio,
                note=note)


def one_line(error):
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def attempt(rows, check, fn, budget=None):
    """Run fn() -> a row (or rows); record FAIL with the one-line error if it raises."""
    if budget is not None and budget.left() <= 0:
        rows.append(row(check, "SKIPPED", note="time budget spent"))
        return
    print(f"gpu-check: {check} ...", flush=True)
    try:
        out = fn()
        rows.extend(out if isinstance(out, list) else [out])
    except Exception as error:   # noqa: BLE001 - one failure must not hide the others
        rows.append(row(check, "FAIL", note=one_line(error)))
    last = rows[-1] if rows else row(check, "?")
    print(f"gpu-check: {check}: done; last row: {last['check']}: {last['result']} "
          f"{last['note']}", flush=True)


# ------------------------------------------------------------------ (b) the building blocks

def batches(device, cfg=SMALL, steps=STEPS):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        idx = torch.randint(cfg.vocab, (BATCH, cfg.seq + 1), generator=g)
        out.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    return out


def train_losses(model, step, device, make_optimizer=None, params=None):
    """STEPS steps of `step(model, x, y) -> loss` (backward inside); the losses."""
    params = list(params if params is not None else model.parameters())
    optimizer = (make_optimizer or (lambda p: torch.optim.SGD(p, lr=LR)))(params)
    losses = []
    for x, y in batches(device):
        optimizer.zero_grad()
        loss = step(model, x, y)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def plain_step(model, x, y):
    loss = model(x, y)
    loss.backward()
    return loss


def judged(check, parallel, build, device, step=plain_step, make_optimizer=None):
    """Row: `parallel(model) -> losses` against the same model trained alone (float32 and
    float64), by numerics.compare_loss."""
    single = train_losses(build().to(device), step, device, make_optimizer)
    exact = train_losses(numerics.exact_copy(build()).to(device), step, device, make_optimizer)
    got = parallel(build().to(device))
    verdict = numerics.compare_loss(got, single, exact)
    return row(check, "PASS" if verdict else "FAIL", f"losses {got[-1]:.4f}",
               f"one device {single[-1]:.4f}", f"{verdict.error:.1e}/{verdict.limit:.1e}",
               str(verdict))


def gpt():
    torch.manual_seed(0)
    return TinyGPT(SMALL)


def moe_gpt():
    return build_moe(seed=0, moe=MoEConfig(experts=4, top_k=1), **SMALL.as_dict())


def syncing_wrapper(check, wrapper_class, device):
    """Row for a wrapper that syncs gradients (DataParallel, FullyShard): forward through it,
    backward, finish_gradient_synchronization, step its parameters."""
    def run(model):
        wrapped = wrapper_class(model)

        def step(m, x, y):
            loss = wrapped(x, y)
            loss.backward()
            wrapped.finish_gradient_synchronization()
            return loss
        return train_losses(wrapped, step, device)
    return judged(check, run, gpt, device)


def check_data_parallel(device):
    from .parallel.data_parallel import DistributedDataParallel
    return syncing_wrapper("DataParallel", DistributedDataParallel, device)


def check_sharded_optimizer(device):
    from .parallel.zero import ShardedOptimizer
    adam = lambda p: torch.optim.Adam(p, lr=LR)                          # noqa: E731
    sharded = lambda p: ShardedOptimizer(p, torch.optim.Adam, stage=2, lr=LR)  # noqa: E731
    return judged("ShardedOptimizer (ZeRO-2, Adam)",
                  lambda m: train_losses(m, plain_step, device, sharded), gpt, device,
                  make_optimizer=adam)


def check_fully_shard(device):
    from .parallel.fully_shard import FullyShard
    return syncing_wrapper("FullyShard (ZeRO-3)", FullyShard, device)


def check_tensor_parallel(device):
    from .parallel.parallel_styles import parallelize_module
    from .parallel.tensor_parallel_plan import gpt_plan
    return judged("parallelize (TP, vocab-parallel)",
                  lambda m: train_losses(parallelize_module(m, None, gpt_plan()), plain_step,
                                         device),
                  gpt, device)


def check_pipeline(device):
    from .parallel.pipeline import PipelineStage, Schedule1F1B, split_into_stages

    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def run(model):
        stage = PipelineStage(split_into_stages(model, 1)[0], 0, 1)
        pipe = Schedule1F1B([stage], 2, loss_fn)

        def step(m, x, y):   # torch's step returns the outputs; the mean loss is reported
            losses = []
            pipe.step(x, target=y, losses=losses)
            return torch.stack(losses).mean()
        return train_losses(model, step, device)
    return judged("PipelineStage + 1F1B (2 micro-batches)", run, gpt, device)


def check_expert_parallel(device):
    from .parallel.moe import ExpertParallel

    def run(model):
        for block in model.blocks:
            block.mlp = ExpertParallel(block.mlp, tag="moe")
        return train_losses(model, plain_step, device)
    return judged("ExpertParallel (4 experts, top-1)", run, moe_gpt, device)


def check_context_parallel(device):
    from .parallel.context_parallelism import ContextParallel
    from .parallel.ring_attention import sequence_positions, shard_sequence
    positions = sequence_positions(SMALL.seq, 0, 1, "zigzag").to(device)

    def run(model):
        for block in model.blocks:
            block.attn = ContextParallel(block.attn, None, "zigzag", "ring")

        def step(m, x, y):
            x, y = shard_sequence(x, None, "zigzag"), shard_sequence(y, None, "zigzag")
            loss = m(x, y, positions=positions)
            loss.backward()
            return loss
        return train_losses(model, step, device)
    return judged("ContextParallel (ring, zigzag)", run, gpt, device)


def check_generate(device):
    from .parallel.serving import generate, generate_without_cache
    model = gpt().to(device).eval()
    prompt = batches(device)[0][0][:, :6]
    with torch.no_grad():
        cached = generate(model, prompt, 8)
        plain = generate_without_cache(model, prompt, 8)
    same = torch.equal(cached.cpu(), plain.cpu())
    return row("serving.generate (KV cache)", "PASS" if same else "FAIL",
               f"{tuple(cached.shape)} tokens", "without cache", "equal" if same else "differ",
               "greedy tokens with the cache equal those without")


BLOCKS = {"DataParallel": check_data_parallel, "ShardedOptimizer": check_sharded_optimizer,
          "FullyShard": check_fully_shard, "parallelize (TP)": check_tensor_parallel,
          "pipeline": check_pipeline, "ExpertParallel": check_expert_parallel,
          "ContextParallel": check_context_parallel, "serving.generate": check_generate}


# ------------------------------------------------------------------ (c) memory

def check_memory(ctx):
    """One step of a larger tiny GPT: the tracker's categories (counted from the tensors that
    exist) against the CUDA allocator (on CPU: the tracker's numbers, no allocator)."""
    device = ctx.device
    cuda = device.type == "cuda"
    model = TinyGPT(GPTConfig(vocab=512, seq=128, hidden=256, heads=4, layers=4,
                              ffn=1024)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    ctx.memory.watch(model=model, optimizer=optimizer)
    x, y = (t.to(device) for t in torch.randint(512, (2, 8, 128)))
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device) - sum(
            p.numel() * p.element_size() for p in model.parameters())
    ctx.memory.reset_peak()
    with ctx.memory.track_activations():
        loss = model(x, y)
        during = torch.cuda.memory_allocated(device) if cuda else None
        loss.backward()
    optimizer.step()
    report = ctx.memory.report()
    steady = report["params"] + report["grads"] + report["optimizer"]
    rows = []
    if not cuda:
        return [row("memory: tracker (no CUDA allocator here)", "INFO",
                    f"{steady:,} B steady", f"activations {report['activations']:,} B")]
    allocated = torch.cuda.memory_allocated(device) - base
    peak = torch.cuda.max_memory_allocated(device) - base
    forward = during - base - report["params"]
    for name, measured, counted in (
            ("memory: params+grads+Adam after the step", allocated, steady),
            ("memory: activations at the end of forward", forward, report["activations"]),
            ("memory: peak of the step", peak, report["peak"])):
        ratio = measured / counted if counted else float("nan")
        rows.append(row(name, "PASS" if 0.8 <= ratio <= 1.25 else "CHECK",
                        f"{measured / 2**20:.2f} MiB (allocator)",
                        f"{counted / 2**20:.2f} MiB (tracker)", f"{ratio:.2f}"))
    return rows


def rank_checks(ctx, budget_s):
    """What runs on the rank: every block, then memory; rows."""
    budget, rows = Budget(budget_s), []
    for name, check in BLOCKS.items():
        attempt(rows, name, lambda: check(ctx.device), budget)
    attempt(rows, "memory", lambda: check_memory(ctx), budget)
    return rows


def block_rows(backend, budget):
    """(b) and (c) in one launch at world size 1 on `backend`; a launch failure is one row."""
    from .runtime.launch import launch
    rows = []
    attempt(rows, f"launch (world size 1, {backend})",
            lambda: launch(rank_checks, 1, max(budget.left() - 20, 10), backend=backend,
                           timeout_s=max(budget.left(), 30))[0], budget)
    return rows


# ------------------------------------------------------------------ (a), (d) and the table

def profile_rows(profile):
    """(a) and (d): the profile's numbers beside the catalog GPU's model of them."""
    from .calibrate import LLAMA_1B, modelled
    from .theory.profile import catalog_gpu, peak_tflops
    g = catalog_gpu(profile["gpu"])
    rows = [row(f"GEMM: best large bf16 ({profile['gpu']})", "MEASURED",
                f"{peak_tflops(profile):.0f} TFLOP/s",
                f"{g.bf16_flops / 1e12:.0f} (datasheet)" if g else "no catalog GPU",
                f"{peak_tflops(profile) * 1e12 / g.bf16_flops:.2f}" if g else ""),
            row("HBM copy (read + write)", "MEASURED", f"{profile['hbm_gbps']:.0f} GB/s",
                f"{g.memory_bw / 1e9:.0f} (datasheet)" if g else "no catalog GPU",
                f"{profile['hbm_gbps'] * 1e9 / g.memory_bw:.2f}" if g else "")]
    model = modelled(profile["gpu"], LLAMA_1B, profile["decode_step_s"],
                     profile["train_step_s"])
    for kind, key in (("decode", "context"), ("train", "seq")):
        for r in profile[f"{kind}_step_s"]:
            m = model.get((kind, r["batch"], r[key]))
            how = f" ({r['mode']}; eager {r['eager_seconds'] * 1e3:.2f} ms)" \
                if "mode" in r else ""
            rows.append(row(f"{kind} step {r['model']} batch {r['batch']} {key} {r[key]}",
                            "MEASURED", f"{r['seconds'] * 1e3:.2f} ms{how}",
                            f"{m * 1e3:.2f} ms" if m else "not modelled",
                            f"{r['seconds'] / m:.2f}" if m else ""))
    if not profile["all_reduce"]:
        rows.append(row("NCCL all-reduce curve", "SKIPPED", note="one GPU: needs 2 or more"))
    return rows


def table(rows):
    """The rows as one markdown table."""
    lines = ["| check | result | measured | modelled | ratio |", "|---|---|---|---|---|"]
    for r in rows:
        note = f" ({r['note']})" if r["note"] and r["result"] in ("FAIL", "SKIPPED") else ""
        cells = (r["check"], r["result"] + note, r["measured"], r["modelled"], r["ratio"])
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def gpu_check(out_dir, budget_s=280.0, device=None, backend=None, calibrate=True):
    """All four parts; writes table.md, rows.json (and profile.json) to out_dir; the rows."""
    from .calibrate import calibrate as measure, no_gpu_reason
    budget, rows, profile = Budget(budget_s), [], None
    cuda = no_gpu_reason() is None if device is None else str(device).startswith("cuda")
    backend = backend or ("nccl" if cuda else "gloo")
    os.makedirs(out_dir, exist_ok=True)
    if calibrate and cuda:
        holder = {}

        def part_a():
            holder["profile"] = measure(quick=True)
            return profile_rows(holder["profile"])
        attempt(rows, "calibrate --quick", part_a, budget)
        profile = holder.get("profile")
    else:
        rows.append(row("calibrate --quick", "SKIPPED", note="no CUDA GPU"))
    rows += block_rows(backend, budget)
    text = table(rows)
    print(text, flush=True)
    # each file whole or not at all (a full disk once left an empty rows.json)
    write_text(os.path.join(out_dir, "table.md"), text + "\n")
    write_json(os.path.join(out_dir, "rows.json"),
               dict(torch=torch.__version__, backend=backend, rows=rows), indent=1)
    if profile is not None:
        write_json(os.path.join(out_dir, "profile.json"), profile, indent=1)
    return rows


def check_arguments(out_dir, budget_s):
    """Refuse, in one line before anything is measured, a budget that checks nothing (0,
    negative, NaN) and an --out-dir that cannot take the files (a file, a place that refuses
    them): the check once ran and exited 0 having checked nothing, or ended in a traceback."""
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) \
            or not 0 < budget_s < math.inf:
        raise ValueError(f"--budget-s must be a positive finite number of seconds, got "
                         f"{budget_s!r}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out-dir {out_dir}: is a file, not a folder; give a folder name")
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe, name = tempfile.mkstemp(dir=out_dir, prefix=".gpu-check-probe-")
        os.close(probe)
        os.remove(name)
    except OSError as error:
        raise ValueError(f"--out-dir {out_dir}: cannot write there "
                         f"({error.strerror or error})") from None


def gpu_check_command(out_dir="build/gpu-check", budget_s=280.0):
    """The CLI: exit 0 when no check FAILed (1 otherwise); runs on CPU too, saying so."""
    check_arguments(out_dir, budget_s)
    start = time.perf_counter()
    rows = gpu_check(out_dir, budget_s)
    failed = [r["check"] for r in rows if r["result"] == "FAIL"]
    print(f"gpu-check: {len(rows)} rows, {len(failed)} FAIL, {time.perf_counter() - start:.0f}"
          f" s; table, rows and profile in {out_dir}/", flush=True)
    return 1 if failed else 0
