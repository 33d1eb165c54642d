"""Ulysses context parallelism (all-to-all over heads) against one device, and ContextParallel
routing attention without patching anything.

On 2 and 4 ranks: this rank's rows of the output and of the q, k, v gradients against fp64
single-device attention on the whole sequence (causal or not, contiguous and zigzag layouts,
grouped-query attention); bf16 inputs within 2x of one device's own bf16 attention error (the
Numbers rule: attention runs in fp32 on each rank's heads, so only the final rounding and the
bf16 exchanges remain); the comm log's bytes against theory/context_parallel.py; the one-line
error for N > KV heads; ContextParallel(method="ulysses") on a module calling
F.scaled_dot_product_attention and on labkit's GPT attention, selected by a predicate, with
`F.scaled_dot_product_attention` and the modules' globals left as they were.
"""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import models
from labkit.parallel import context_parallelism as cp
from labkit.theory import context_parallel as theory

B, H, D, SEQ = 2, 8, 8, 64
ORIGINAL_SDPA = F.scaled_dot_product_attention


def _inputs(heads, kv_heads, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, heads, SEQ, D, generator=g, dtype=torch.float64).to(dtype)
             for _ in range(2))
    k, v = (torch.randn(B, kv_heads, SEQ, D, generator=g, dtype=torch.float64).to(dtype)
            for _ in range(2))
    return q, k, v, do


def _errors(causal, layout, dtype=torch.float32, heads=H, kv_heads=H):
    """max |ulysses - fp64 one device| over (out, dq, dk, dv) rows of this rank."""
    q, k, v, do = _inputs(heads, kv_heads, dtype)
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=causal,
                                              enable_gqa=heads != kv_heads)
    expected.backward(do.double())
    mine = [cp.shard_sequence(t, None, layout, dim=2).requires_grad_() for t in (q, k, v)]
    out = cp.ulysses_attention(*mine, None, causal, layout)
    out.backward(cp.shard_sequence(do, None, layout, dim=2))
    pairs = [(out, expected)] + [(m.grad, f.grad) for m, f in zip(mine, full)]
    return [(a.double() - cp.shard_sequence(b.detach(), None, layout, dim=2)).abs().max().item()
            for a, b in pairs]


class SDPAAttention(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        assert F.scaled_dot_product_attention is ORIGINAL_SDPA     # nothing patched
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


def _module_diff(ctx, module, **wrap):
    """ContextParallel(module) on shards against the module on the whole sequence: the largest
    difference relative to the largest value (output, each weight gradient summed over ranks);
    fp32 sums in a different order, so ~1e-7 of the scale each."""
    x = torch.randn(2, 8 * ctx.world_size, 32, generator=torch.Generator().manual_seed(1))
    expected = module(x)
    expected.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    globals_before = dict(vars(models))
    y = cp.ContextParallel(module, layout="zigzag", method="ulysses", **wrap)(
        cp.shard_sequence(x, None, "zigzag"))
    y.pow(2).sum().backward()
    assert dict(vars(models)) == globals_before
    pairs = [(cp.gather_sequence(y.detach(), None, "zigzag"), expected.detach())] + [
        (ctx.comm.all_reduce(p.grad.clone()), grads[name]) for name, p in
        module.named_parameters()]
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)


def ulysses_checks(ctx):
    out = {(causal, layout): max(_errors(causal, layout)) for causal in (True, False)
           for layout in cp.LAYOUTS}
    out["gqa"] = max(_errors(True, "zigzag", heads=H, kv_heads=4))
    out["bf16"] = _errors(True, "zigzag", torch.bfloat16)
    ctx.comm.reset()
    _errors(True, "contiguous", heads=H, kv_heads=4)
    out["wire"] = sum(r["wire_bytes_per_rank"] for r in ctx.comm.summary(by=("op", "tag"))
                      if r["tag"].startswith("ulysses"))
    with ctx.off_the_record():
        torch.manual_seed(0)
        out["sdpa module"] = _module_diff(ctx, SDPAAttention())
        torch.manual_seed(0)
        block = models.Block(models.GPTConfig(hidden=32, heads=4, ffn=64))
        out["labkit block"] = _module_diff(ctx, block,
                                           attention=lambda m: isinstance(m, models.Attention))
    try:
        kv_heads = ctx.world_size // 2      # fewer K/V heads than ranks
        cp.ulysses_attention(torch.zeros(1, 4 * kv_heads, 4, 8),
                             torch.zeros(1, kv_heads, 4, 8), torch.zeros(1, kv_heads, 4, 8))
        out["error"] = None
    except ValueError as error:
        out["error"] = str(error)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, labkit.launch(ulysses_checks, request.param, timeout_s=300)


def _single_device_bf16_error():
    q, k, v, do = _inputs(H, H, torch.bfloat16)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, is_causal=True)
    ref.backward(do.double())
    got = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*got, is_causal=True)
    out.backward(do)
    pairs = [(out, ref)] + [(a.grad, b.grad) for a, b in zip(got, exact)]
    return [(a.double() - b.detach()).abs().max().item() for a, b in pairs]


def test_ulysses_equals_one_device_fp32(ranks):
    n, results = ranks
    for key in [(c, layout) for c in (True, False) for layout in cp.LAYOUTS] + ["gqa"]:
        worst = max(r[key] for r in results)
        assert worst < 1e-5, f"{n} ranks, {key}: {worst:.2e}"


def test_ulysses_bf16_within_one_devices_own_error(ranks):
    n, results = ranks
    floor = _single_device_bf16_error()
    for i, base in enumerate(floor):
        got = max(r["bf16"][i] for r in results)
        assert got <= max(2 * base, 1e-2), (n, i, got, base)


def test_ulysses_bytes_match_the_formula_and_fall_with_n(ranks):
    n, results = ranks
    expected = theory.comm_bytes_per_rank(B, H, SEQ, D, n, dtype_bytes=4, grad_bytes=4,
                                          method="ulysses", kv_heads=4)["total"]
    assert all(r["wire"] == pytest.approx(expected) for r in results)
    per_n = [theory.comm_bytes_per_rank(1, 32, 131072, 128, k, kv_heads=8,
                                        method="ulysses")["total"] for k in (2, 4, 8)]
    ring = [theory.comm_bytes_per_rank(1, 32, 131072, 128, k, kv_heads=8)["total"]
            for k in (2, 4, 8)]
    assert per_n[0] > per_n[1] > per_n[2] and ring[2] > ring[0]


def test_context_parallel_routes_without_patching(ranks):
    n, results = ranks
    assert all(r["sdpa module"] < 1e-5 and r["labkit block"] < 1e-5 for r in results)


def test_more_ranks_than_kv_heads_is_a_one_line_error(ranks):
    n, results = ranks
    error = results[0]["error"]
    assert error and "\n" not in error and f"do not split over {n} ranks" in error
    assert "N <= KV heads" in error


# ------------------------------------------------------------------------- the CLI driver

def _labkit(*args):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_runs_ulysses_and_its_bytes_are_the_formulas():
    """`run cp --method ulysses` on 2 ranks: the training run's comm log and the attention
    check's bytes equal theory/'s (Ulysses' volume, not ring's), the results one device's."""
    out = _labkit("run", "cp", "--world-size", "2", "--method", "ulysses", "--steps", "2",
                  "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["config"]["method"] == "ulysses"
    assert report["agreement"]["params"]["ok"], report["agreement"]["params"]["verdict"]
    measured = sum(row["wire_bytes_per_rank"] for row in report["comm"])
    assert {row["op"] for row in report["comm"]} == {"all_to_all", "all_reduce"}
    assert measured == pytest.approx(report["predicted_comm_bytes_per_rank"])
    check = report["attention_check"]
    assert check["within_rounding"], check["verdict"]
    b, h, s, d = (check["shape"][k] for k in ("batch", "heads", "seq", "head_dim"))
    expected = theory.comm_bytes_per_rank(b, h, s, d, 2, dtype_bytes=4, grad_bytes=4,
                                          method="ulysses")["total"]
    assert check["predicted_comm_bytes_per_rank"] == pytest.approx(expected)
    assert check["comm_bytes_per_rank"] == pytest.approx([expected] * 2)
    ring = theory.comm_bytes_per_rank(b, h, s, d, 2, dtype_bytes=4, grad_bytes=4)["total"]
    assert expected != pytest.approx(ring)


def test_cli_refuses_more_ranks_than_heads_in_one_line():
    out = _labkit("run", "cp", "--world-size", "8", "--method", "ulysses")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "do not split over 8 ranks" in out.stderr
    assert "N <= KV heads" in out.stderr
