"""ctx.comm (every collective, fp32 and bf16, logged), ctx.clock (sync, async lane, p2p) and
ctx.memory (categories, unique storages, agreement with theory/ on the tiny model)."""
import pytest
import torch

import labkit
from labkit.runs import reference
from labkit.runtime.memory import MemoryTracker, storage_bytes

# The modelled cluster by hand from data/hardware.csv (not through theory/'s formulas): an H100
# does 989e12 bf16 FLOP/s at the clock's mfu 0.5; NVLink 4 moves 450e9 * 0.8 bytes/s after 2 us.
H100_FLOP_S = 989e12 * 0.5
NVLINK_B_S, NVLINK_ALPHA = 450e9 * 0.8, 2e-6


def every_collective(ctx, dtype):
    n, r = ctx.world_size, ctx.rank
    out = {}
    t = torch.full((4,), float(r + 1), dtype=dtype)
    out["all_reduce"] = ctx.comm.all_reduce(t.clone()).tolist()
    out["avg"] = ctx.comm.all_reduce(t.clone(), op="avg").tolist()
    out["all_gather"] = ctx.comm.all_gather(torch.tensor([float(r)], dtype=dtype)).tolist()
    out["reduce_scatter"] = ctx.comm.reduce_scatter(
        torch.arange(2 * n, dtype=dtype)).tolist()
    b = torch.full((3,), float(r), dtype=dtype)
    out["broadcast"] = ctx.comm.broadcast(b, src=1).tolist()
    out["all_to_all"] = ctx.comm.all_to_all(
        (torch.arange(n) + 10 * r).to(dtype)).tolist()
    h = ctx.comm.all_reduce(torch.ones(2, dtype=dtype), async_op=True)
    out["async"] = h.wait().tolist()
    nxt, prv = (r + 1) % n, (r - 1) % n
    send = ctx.comm.send(torch.full((2,), float(r), dtype=dtype), nxt, async_op=True)
    got = ctx.comm.recv(torch.zeros(2, dtype=dtype), prv)
    send.wait()
    out["recv"] = got.tolist()
    ctx.comm.barrier()
    out["summary"] = ctx.comm.summary()
    out["records"] = ctx.comm.dataframe().to_dict("records")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_collective_works_and_is_logged(dtype):
    n = 4
    results = labkit.launch(every_collective, n, dtype)
    for r, out in enumerate(results):
        assert out["all_reduce"] == [10.0] * 4
        assert out["avg"] == [2.5] * 4
        assert out["all_gather"] == [0.0, 1.0, 2.0, 3.0]
        assert out["reduce_scatter"] == [4.0 * (2 * r), 4.0 * (2 * r + 1)]
        assert out["broadcast"] == [1.0] * 3
        assert out["all_to_all"] == [float(r + 10 * s) for s in range(n)]
        assert out["async"] == [4.0, 4.0]
        assert out["recv"] == [float((r - 1) % n)] * 2
    ops = {row["op"]: row for row in results[0]["summary"]}
    assert set(ops) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                        "all_to_all", "send", "recv", "barrier"}
    size = 2 if dtype == torch.bfloat16 else 4
    assert ops["all_reduce"]["calls"] == 3
    assert ops["all_reduce"]["bytes"] == (4 + 4 + 2) * size
    assert ops["all_reduce"]["wire_bytes_per_rank"] == pytest.approx(2 * 3 / 4 * 10 * size)
    assert ops["all_gather"]["wire_bytes_per_rank"] == pytest.approx(3 * size)  # (n-1) shards
    assert ops["reduce_scatter"]["wire_bytes_per_rank"] == pytest.approx(3 / 4 * 8 * size)
    assert ops["send"]["wire_bytes_per_rank"] == 2 * size
    records = results[0]["records"]
    assert {"op", "group_size", "bytes", "wire_bytes_per_rank", "wall_s", "modelled_s"} \
        <= set(records[0])
    assert all(rec["modelled_s"] > 0 for rec in records if rec["op"] != "barrier")
    # a broadcast of 3 elements on 4 ranks: 3 chained steps, the root sends all 3 * size bytes
    bcast = next(rec for rec in records if rec["op"] == "broadcast")
    assert bcast["modelled_s"] == pytest.approx(3 * NVLINK_ALPHA + 3 * size / NVLINK_B_S)


def late_rank_then_all_reduce(ctx):
    if ctx.rank == 1:
        ctx.clock.add_compute("extra work", 1e12)  # 1 TFLOP: ~2 ms on a modelled H100
    ctx.comm.all_reduce(torch.ones(1000))
    return ctx.clock.now(), ctx.clock.timeline(), ctx.clock.cluster.name


def test_a_collective_starts_when_its_last_member_arrives():
    (t0, tl0, name), (t1, tl1, _) = labkit.launch(late_rank_then_all_reduce, 2)
    assert name == "8xH100-NVLink" and t0 == pytest.approx(t1)
    late = 1e12 / H100_FLOP_S
    # ring all-reduce on 2 ranks: 2 steps, 2 (n-1)/n * 4000 = 4000 bytes sent by each
    assert t0 == pytest.approx(late + 2 * NVLINK_ALPHA + 4000 / NVLINK_B_S)
    idle = [e for e in tl0 if e["kind"] == "idle"]   # rank 0 waited exactly as long as rank 1
    assert len(idle) == 1 and idle[0]["end"] - idle[0]["start"] == pytest.approx(late)
    assert not any(e["kind"] == "idle" for e in tl1)


def async_overlap(ctx):
    h = ctx.comm.all_reduce(torch.ones(250_000), async_op=True)  # 1 MB
    ctx.clock.add_compute("independent work", 2e11)
    h.wait()
    return ctx.clock.now(), ctx.clock.timeline()


def test_async_collectives_run_on_their_own_lane_and_overlap_compute():
    now, timeline = labkit.launch(async_overlap, 2)[0]
    comm = [e for e in timeline if e["lane"] == "comm"]
    compute = [e for e in timeline if e["kind"] == "compute"]
    assert len(comm) == 1 and len(compute) == 1
    assert comm[0]["start"] == pytest.approx(0.0)
    assert comm[0]["start"] < compute[0]["end"]  # they overlap
    assert now == pytest.approx(max(comm[0]["end"], compute[0]["end"]))


def pipeline_of_two(ctx):
    x = torch.ones(1000)
    if ctx.rank == 0:
        ctx.clock.add_compute("forward", 1e11)
        ctx.comm.send(x, 1)
    else:
        ctx.comm.recv(x, 0)
    return ctx.clock.now()


def test_a_message_arrives_at_the_sender_time_plus_transfer():
    t0, t1 = labkit.launch(pipeline_of_two, 2)
    forward = 1e11 / H100_FLOP_S
    assert t1 == pytest.approx(forward + NVLINK_ALPHA + 4000 / NVLINK_B_S)   # one message
    assert t0 == pytest.approx(forward)   # the sender does not wait for the transfer


def counted_flops(ctx):
    a = torch.randn(64, 32)
    with ctx.clock.compute("matmul"):
        a @ torch.randn(32, 16)
    return ctx.clock.flops, ctx.clock.now()


def test_compute_regions_count_flops_with_flop_counter_mode():
    flops, now = labkit.launch(counted_flops, 1)[0]
    assert flops == 2 * 64 * 32 * 16
    assert now == pytest.approx(2 * 64 * 32 * 16 / H100_FLOP_S)


def test_views_of_one_storage_count_once():
    base = torch.zeros(100)
    assert storage_bytes([base, base[:10], base.view(10, 10)]) == 400
    assert storage_bytes([torch.zeros(10), torch.zeros(10)]) == 80


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_memory_tracker_agrees_with_theory_on_the_tiny_model(model):
    cfg = reference.RunConfig(model=model, steps=2)
    measured = reference.train(cfg)["memory"]
    predicted = reference.predict_memory(cfg)
    for category in ("params", "grads", "optimizer"):
        assert measured[category] == predicted[category], category
    assert measured["activations"] == pytest.approx(predicted["activations"], rel=0.15)
    assert measured["peak"] <= predicted["peak"]


def test_activations_are_released_after_backward():
    model = reference.build_model(reference.RunConfig())
    tracker = MemoryTracker().watch(model=model)
    x, y = reference.batch(model, reference.RunConfig(), 0)
    with tracker.track_activations():
        loss = model(x, y)
        held = tracker.saved_bytes
        loss.backward()
    assert held > 0 and tracker.saved_bytes == 0
    assert tracker.max_saved_bytes == held


def send_with_the_clock_off(ctx):
    ctx.clock.enabled = False
    x = torch.full((3,), float(ctx.rank))
    if ctx.rank == 0:
        ctx.comm.send(x, 1, async_op=True).wait()
        ctx.comm.send(x, 1)
    else:
        ctx.comm.recv(x, 0)
        ctx.comm.recv(x, 0, async_op=True).wait()
    return x.tolist(), ctx.clock.now()


def test_point_to_point_works_with_the_clock_off():
    assert labkit.launch(send_with_the_clock_off, 2) == [([0.0] * 3, 0.0), ([0.0] * 3, 0.0)]
