"""ctx.comm (every collective, fp32 and bf16, logged), ctx.clock (sync, async lane, p2p; the
same modelled times as the previous clock; its stamps carried inside the ops and logged as its
own; FLOPs as FlopCounterMode counts them) and ctx.memory (categories, unique storages,
agreement with theory/ on the tiny model, the same peak as recounting at every save)."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import labkit
from labkit.runs import reference
from labkit.runtime import flops, stamps
from labkit.runtime.memory import MemoryTracker, storage_bytes
from previous_clock import PREVIOUS_CLOCK

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


# --- the clock: the previous implementation's modelled times, its own comm ---------------------

def fixed_scenario(ctx):
    """Sync collectives with late ranks, async overlap (waited out of order), sub-groups, p2p
    (async and sync, in a ring and in pairs), broadcast, all_to_all, barrier, two steps."""
    r, n = ctx.rank, ctx.world_size
    pair = ctx.split_groups([[0, 1], [2, 3]])
    ctx.clock.add_compute("uneven", (r + 1) * 1e11)
    ctx.comm.all_reduce(torch.ones(1000), tag="sync")
    h1 = ctx.comm.all_reduce(torch.ones(250_000), async_op=True, tag="big")
    h2 = ctx.comm.all_gather(torch.ones(100), async_op=True, tag="small")
    ctx.clock.add_compute("overlapped", 2e11)
    h2.wait()
    h1.wait()
    with ctx.clock.compute("matmul"):
        torch.randn(64, 32) @ torch.randn(32, 16 * (r + 1))
    ctx.comm.reduce_scatter(torch.ones(4000), group=pair, tag="pair")
    ctx.clock.mark_step()
    with ctx.off_the_record():
        ctx.comm.all_reduce(torch.ones(10))
    nxt, prv = (r + 1) % n, (r - 1) % n
    ctx.clock.add_compute("before send", (n - r) * 5e10)
    s = ctx.comm.send(torch.ones(2000), nxt, async_op=True, tag="ring")
    ctx.comm.recv(torch.zeros(2000), prv, tag="ring")
    s.wait()
    if r % 2 == 0:
        ctx.comm.send(torch.ones(500), 1, group=pair)
    else:
        ctx.comm.recv(torch.zeros(500), 0, group=pair, async_op=True).wait()
    ctx.comm.broadcast(torch.ones(300), src=2)
    ctx.comm.all_to_all(torch.ones(8 * n))
    ctx.comm.barrier()
    ctx.clock.mark_step()
    events = [(e["lane"], e["kind"], e["name"], e["start"], e["end"])
              for e in ctx.clock.timeline()]
    return dict(now=ctx.clock.now(), steps=ctx.clock.step_times(), events=events,
                technique=ctx.comm.summary(), wire=ctx.comm.wire_bytes(),
                everything=ctx.comm.summary(by=("op", "tag"), clock=True),
                clock_wire=ctx.comm.wire_bytes(clock=True))


@pytest.fixture(scope="module")
def scenario():
    return labkit.launch(fixed_scenario, 4)


def test_modelled_times_are_those_of_the_previous_clock(scenario):
    for got, pinned in zip(scenario, PREVIOUS_CLOCK):
        assert got["now"] == pytest.approx(pinned["now"], rel=1e-12)
        assert got["steps"] == pytest.approx(pinned["steps"], rel=1e-12)
        assert [e[:3] for e in got["events"]] == [tuple(e[:3]) for e in pinned["events"]]
        assert [t for e in got["events"] for t in e[3:]] == pytest.approx(
            [t for e in pinned["events"] for t in e[3:]], rel=1e-12, abs=1e-18)


def test_the_clocks_stamps_are_logged_as_its_own(scenario):
    rank0 = scenario[0]
    clock = {row["op"]: row for row in rank0["everything"] if row["tag"] == "clock"}
    # every op that synchronised clocks carried (or, for a broadcast, sent beside it) stamps;
    # the all_reduce off the record is not there
    assert set(clock) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                          "all_to_all", "send", "recv", "barrier"}
    assert clock["all_reduce"]["calls"] == 2           # the sync one and the async one
    assert clock["all_reduce"]["bytes"] == 2 * 4 * 4 * 4   # 4 members x 4 fp32 slots, twice
    assert clock["all_gather"]["bytes"] == 8 and clock["send"]["bytes"] == 2 * 8
    assert clock["reduce_scatter"]["bytes"] == 2 * 2 * 4 * 4   # a pair: 2 pieces x 2 x 4 slots
    assert all(row["modelled_s"] == 0 for row in clock.values())  # a real cluster has no clock
    # the technique's rows and wire bytes are those of its own data only
    assert all("tag" not in row for row in rank0["technique"])
    technique = {(row["op"], row["group"]): row for row in rank0["technique"]}
    assert technique[("all_reduce", "0-3")]["bytes"] == 4000 + 1_000_000
    assert technique[("all_reduce", "0-3")]["calls"] == 2
    assert rank0["wire"] == pytest.approx(sum(r["wire_bytes_per_rank"]
                                              for r in rank0["technique"]))
    assert rank0["clock_wire"] == pytest.approx(sum(r["wire_bytes_per_rank"]
                                                    for r in clock.values()))
    assert 0 < rank0["clock_wire"] < 1e-3 * rank0["wire"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16,
                                   torch.int64, torch.int32, torch.int16, torch.int8,
                                   torch.uint8])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_stamps_survive_a_reduction_in_the_payload_dtype(dtype, op):
    """Each member's slots, reduced as gloo reduces them, give back every stamp bit for bit."""
    times = [0.0012273859689131558, 3.0e-9, 0.0, 17.25]   # modelled seconds, any float64
    slots = []
    for rank, issued in enumerate(times):
        timing = type("Timing", (), dict(issued=issued, group_ready=None))
        group = type("Group", (), dict(size=len(times), rank=rank))
        slots.append(stamps.reduction_slots(dtype, op, group, timing))
        assert slots[-1].dtype == dtype
    reduce = dict(sum=torch.add, max=torch.maximum, min=torch.minimum)[op]
    reduced = functools.reduce(reduce, slots)
    assert reduced.dtype == dtype
    assert stamps.read_slots(reduced, dtype) == max(times)


def exotic_dtypes_and_splits(ctx):
    """Payloads that cannot carry slots (bool) exchange stamps beside the op; uneven splits."""
    r = ctx.rank
    ctx.clock.add_compute("late", (r + 1) * 1e11)
    flags = ctx.comm.all_reduce(torch.tensor([r == 1, False]), op="max")
    sizes = [1, 2] if r == 0 else [3, 1]
    got = ctx.comm.all_to_all(torch.full((sum(sizes), 2), float(r)), input_splits=sizes)
    tiny = ctx.comm.all_gather(torch.tensor(float(r)).reshape(1))
    return flags.tolist(), got.tolist(), tiny.tolist(), ctx.clock.now()


def test_payloads_of_any_dtype_and_uneven_all_to_all():
    (f0, g0, t0, now0), (f1, g1, t1, now1) = labkit.launch(exotic_dtypes_and_splits, 2)
    assert f0 == f1 == [True, False]
    assert g0 == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]   # 1 of mine, 3 of rank 1's
    assert g1 == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    assert t0 == t1 == [0.0, 1.0]
    assert now0 == pytest.approx(now1)   # both waited for the late rank at the first op


# --- FLOPs: what FlopCounterMode counts, for less -----------------------------------------------

def _flop_cases():
    torch.manual_seed(0)
    a, b = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
    x3 = torch.randn(2, 8, 16, requires_grad=True)
    lin, conv = torch.nn.Linear(16, 5), torch.nn.Conv2d(3, 6, 3, stride=2, padding=1)
    img, q = torch.randn(2, 3, 9, 9, requires_grad=True), torch.randn(2, 4, 8, 16)
    return dict(
        mm=lambda: (a @ b).sum().backward(),
        addmm=lambda: torch.addmm(torch.randn(4), a, b).sum().backward(),
        bmm=lambda: (x3 @ x3.transpose(1, 2)).sum().backward(),
        baddbmm=lambda: torch.baddbmm(torch.zeros(2, 8, 8), x3, x3.transpose(1, 2)).sum(),
        linear_3d=lambda: lin(x3).sum().backward(),
        conv=lambda: conv(img).sum().backward(),
        no_grad=lambda: torch.no_grad()(lin)(x3))


@pytest.mark.parametrize("case", list(_flop_cases()))
def test_compute_regions_count_what_flop_counter_mode_counts(case):
    run = _flop_cases()[case]
    with FlopCounterMode(display=False) as reference_count:
        run()
    for _ in range(2):   # the second time from the remembered shapes
        counter = flops.start_counting()
        run()
        flops.stop_counting(counter)
        assert counter.flops == reference_count.get_total_flops()


def test_attention_on_cpu_counts_what_torch_counts_for_the_gpu_kernels():
    # FlopCounterMode has no formula for the CPU kernel (it counts 0); labkit counts its matmuls:
    # Q K^T and P V forward, 5 backward (scores again, dV, dP, dQ, dK), each 2 b h s s d FLOPs
    b, h, s, d = 2, 4, 8, 16
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = torch.randn(b, h, 2 * s, d), torch.randn(b, h, 2 * s, d)
    matmul = 2 * b * h * s * (2 * s) * d
    counter = flops.start_counting()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, 2 * s).bool())
    forward = counter.flops
    out.sum().backward()
    flops.stop_counting(counter)
    assert (forward, counter.flops) == (2 * matmul, 7 * matmul)


@pytest.mark.parametrize("name", flops.ELEMENTWISE_OPTIMIZERS)
def test_torch_optimizers_step_outside_the_counter_because_they_count_zero(name):
    model = torch.nn.Linear(8, 8)
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    with FlopCounterMode(display=False) as reference_count:
        optimizer.step()
    assert reference_count.get_total_flops() == 0
    counter = flops.start_counting()
    optimizer.step()
    stepped_outside = torch.utils._python_dispatch._get_current_dispatch_mode() is counter
    flops.stop_counting(counter)
    assert counter.flops == 0 and stepped_outside   # the counter is back after the step

    def closure():   # a closure runs forward inside step: its FLOPs count
        return model(torch.randn(4, 8)).sum()
    with FlopCounterMode(display=False) as reference_count:
        optimizer.step(closure)
    counter = flops.start_counting()
    optimizer.step(closure)
    flops.stop_counting(counter)
    assert counter.flops == reference_count.get_total_flops() > 0


# --- memory: the same peak as recounting the gradients at every save ---------------------------

class _RecountEveryTime(MemoryTracker):
    """The tracker as it was: every save and every use in backward recounts the gradients."""

    def _update_peak(self, phase):
        total = self._static + storage_bytes(self.sources["grads"]()) + self.saved_bytes
        if total > self.peak:
            self.peak, self.peak_phase = total, phase


def _track(tracker_class, free_grads_in_backward):
    cfg = reference.RunConfig(model_kwargs=dict(layers=3))
    model = reference.build_model(cfg)
    optimizer = reference.build_optimizer(model.parameters(), cfg)
    tracker = tracker_class().watch(model=model, optimizer=optimizer)
    if free_grads_in_backward:   # like ZeRO-2: a gradient leaves as soon as it is made
        for p in list(model.parameters())[::3]:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    for step in range(2):
        x, y = reference.batch(model, cfg, step)
        optimizer.zero_grad(set_to_none=True)
        with tracker.track_activations():
            for mx, my in zip(x.chunk(2), y.chunk(2)):   # forward, backward, forward, backward
                model(mx, my).backward()
        optimizer.step()
        tracker.sample(f"after step {step}")
    return tracker.report(), tracker.samples


@pytest.mark.parametrize("free_grads_in_backward", [False, True])
def test_memory_peak_is_the_same_as_recounting_at_every_save(free_grads_in_backward):
    assert _track(MemoryTracker, free_grads_in_backward) == \
        _track(_RecountEveryTime, free_grads_in_backward)
