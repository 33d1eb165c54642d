"""Overlap you can watch: FullyShard's prefetch hides all-gathers on the modelled clock, no_sync
saves K-1 of K all-reduces, torch.profiler's trace of a rank is valid Chrome trace JSON."""
import json

import matplotlib
import pytest
import torch

import labkit
from labkit import data
from labkit.parallel.data_parallel import DataParallel
from labkit.runs import data_parallel as dp
from labkit.runs import zero
from labkit.runs.reference import RunConfig, batch, build_model
from labkit.runtime import profiler, trace
from labkit.theory.data_parallel import gradient_bytes
from labkit.viz.overlap import accumulation_bars, overlap_timeline

matplotlib.use("Agg")
WIDE = RunConfig(steps=1, global_batch=32, optimizer="sgd",
                 model_kwargs=dict(hidden=128, layers=4, ffn=512))


@pytest.fixture(scope="module")
def fsdp_runs():
    return {p: [e for r in labkit.launch(zero.train, 2, WIDE, stage=3, prefetch=p,
                                         timeout_s=300) for e in r["timeline"]]
            for p in (True, False)}


def test_prefetch_leaves_less_all_gather_exposed(fsdp_runs):
    on, off = (trace.overlap_by_op(fsdp_runs[p], rank=0)["all_gather"] for p in (True, False))
    assert on["calls"] == off["calls"] and on["modelled_s"] == pytest.approx(off["modelled_s"])
    assert off["hidden_s"] == pytest.approx(0.0, abs=1e-12)   # gathered when needed: all waited
    assert on["hidden_s"] > 0 and on["exposed_s"] < off["exposed_s"]
    assert on["exposed_s"] + on["hidden_s"] == pytest.approx(on["modelled_s"])


def test_exposed_time_adds_up_to_the_compute_lane_waits(fsdp_runs):
    # Lesson 04's table: each op's exposed part is time the compute lane waited for it, so over
    # a rank they sum to its waits (an already-placed op's wait once placed later ops as exposed)
    for timeline in fsdp_runs.values():
        mine = [e for e in timeline if e["rank"] == 0]
        exposed = sum(e["meta"]["exposed_s"] for e in mine if "exposed_s" in e["meta"])
        waits = sum(e["end"] - e["start"] for e in mine
                    if e["lane"] == "compute" and e["kind"] == "idle")
        assert exposed == pytest.approx(waits, rel=1e-9, abs=1e-12)


def test_overlap_timeline_hatches_each_exposed_collective(fsdp_runs):
    runs = {f"prefetch={p}": tl for p, tl in fsdp_runs.items()}
    fig = overlap_timeline(runs, ranks=(0, 1))
    assert len(fig.axes) == 2
    for ax, tl in zip(fig.axes, runs.values()):
        exposed = sum(1 for e in tl if e.get("meta", {}).get("exposed_s", 0) > 0)
        hatched = [p for p in ax.patches if p.get_hatch()]
        assert len(hatched) == exposed > 0
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("exposed" in t for t in legend) and any("all-gather" in t for t in legend)
    wall = overlap_timeline(runs, clock="wall")
    assert not any(p.get_hatch() for ax in wall.axes for p in ax.patches)
    with pytest.raises(ValueError, match="clock"):
        overlap_timeline(runs, clock="gpu")


def sync_every_micro_batch(ctx, cfg, k):
    """Gradient accumulation that all-reduces after every micro-batch (no no_sync)."""
    model = DataParallel(build_model(cfg), bucket_mb=dp.DEFAULT_BUCKET_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        with ctx.step(step):
            x, y = (data.shard(t, ctx.rank, ctx.world_size)
                    for t in batch(model.module, cfg, step))
            optimizer.zero_grad(set_to_none=True)
            for mx, my in zip(x.chunk(k), y.chunk(k)):
                (model(mx, my) / k).backward()   # each backward all-reduces its buckets
            optimizer.step()
    return dict(comm=ctx.comm.summary(),
                params={n: p.detach().clone() for n, p in model.module.named_parameters()})


def all_reduce_per_step(result, steps):
    rows = [r for r in result["comm"] if r["op"] == "all_reduce"]
    return sum(r["bytes"] for r in rows) / steps, sum(r["calls"] for r in rows) / steps


def test_no_sync_all_reduces_one_kth_of_the_bytes():
    k, cfg = 4, RunConfig(steps=2, global_batch=16, optimizer="sgd")
    every = labkit.launch(sync_every_micro_batch, 2, cfg, k, timeout_s=300)[0]
    quiet = labkit.launch(dp.train, 2, cfg, accumulate=k, timeout_s=300)[0]
    every_bytes, every_calls = all_reduce_per_step(every, cfg.steps)
    quiet_bytes, quiet_calls = all_reduce_per_step(quiet, cfg.steps)
    assert quiet_bytes == gradient_bytes(build_model(cfg))   # one all-reduce per step
    assert every_bytes == k * quiet_bytes and every_calls == k * quiet_calls
    # the same step either way: the average of sums is the sum of averages (float32 rounding)
    for name, p in quiet["params"].items():
        torch.testing.assert_close(every["params"][name], p, rtol=1e-5, atol=1e-6)
    fig = accumulation_bars({
        "every": dict(bytes_per_step=every_bytes, calls_per_step=every_calls,
                      formula_bytes=k * quiet_bytes, exposed_s=4e-5),
        "no_sync": dict(bytes_per_step=quiet_bytes, formula_bytes=quiet_bytes,
                        calls_per_step=quiet_calls, exposed_s=1e-5)})
    widths = [p.get_width() for p in fig.axes[0].patches]
    assert widths == pytest.approx([every_bytes / 1e6, quiet_bytes / 1e6])


def test_profiled_rank_writes_a_chrome_trace_with_the_collectives(tmp_path):
    path = tmp_path / "rank0.json"
    cfg = RunConfig(steps=1, global_batch=8, optimizer="sgd")
    out = labkit.launch(profiler.profiled, 2, dp.train, cfg, path=path, timeout_s=300)
    assert out[1]["profile"] is None and out[1]["result"]["loss"]
    summary = out[0]["profile"]
    with open(path) as f:
        raw = json.load(f)   # valid JSON
    events = profiler.trace_events(path)
    assert len(events) > 100 and raw["traceEvents"]
    for e in events:
        assert isinstance(e["name"], str) and e["ts"] >= 0 and e["dur"] >= 0
    counts = profiler.collective_counts(events)
    assert counts == summary["collectives"]
    log = {r["op"]: r["calls"] for r in out[0]["result"]["comm"]}
    # one for one: the clock sends nothing of its own through gloo (its posts go to the store)
    assert counts["gloo:broadcast"] == log["broadcast"]
    assert counts["gloo:all_reduce"] == log["all_reduce"]
    # the five costliest operators: which ones depends on the machine's load (a busy CPU makes
    # the collectives' waits the costliest), but PyTorch's own ops are in the trace
    assert len(summary["top_ops"]) == 5
    assert any(e["name"].startswith("aten::") for e in events)
