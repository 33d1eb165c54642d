"""ctx.comm (every collective, fp32 and bf16, logged; each sends its tensor's bytes and nothing
else), ctx.clock (sync, async lane, p2p; the same modelled times as the previous clock; a
hand-written log replayed; each rank's log replays to its timeline; FLOPs as FlopCounterMode
counts them) and ctx.memory (categories, unique storages, agreement with theory/ on the tiny
model, the same peak as recounting at every save)."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import labkit
from labkit.runs import reference
from labkit.runtime import flops
from labkit.runtime.clock import replay
from labkit.runtime.memory import MemoryTracker, storage_bytes
from labkit.theory import hardware, kernels, time as ttime
from previous_clock import PREVIOUS_CLOCK

# The modelled cluster by hand from data/hardware.csv (not through theory/'s formulas): an H100
# runs compute at its measured MAMF (bf16) x the fitted in-step GEMM fraction (data/kernels.csv);
# NVLink 4 moves ~370e9 bytes/s (NCCL's effective rate on its 450 GB/s, nccl-tests issue 212)
# after 2 us, where no measured curve covers the op (all-reduces read NVLink 4's curve).
H100_FLOP_S = hardware.gpu("H100").mamf_bf16_flops * kernels.IN_STEP_GEMM_FRACTION
NVLINK_B_S, NVLINK_ALPHA = 450e9 * 0.822, 2e-6   # efficiency 0.822 = 370 / 450, rounded


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
        ctx.clock.add_compute("extra work", 1e12)  # 1 TFLOP: ~1.6 ms on a modelled H100
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
                technique=ctx.comm.summary(), wire=ctx.comm.wire_bytes(), log=ctx.clock.log)


@pytest.fixture(scope="module")
def scenario():
    return labkit.launch(fixed_scenario, 4)


def previous_collective_time(op, nbytes, group_size, link):
    """The previous clock's price of a collective: alpha-beta on NVLink 4 at 0.8 of its line
    rate for every op (collectives now read measured curves: tests/test_collective_curves.py)."""
    assert hardware.link(link).name == "NVLink 4"
    if group_size <= 1:
        return 0.0
    wire = ttime.busiest_rank_bytes("send" if op == "recv" else op, nbytes, group_size)
    return ttime.ring_steps(op, group_size) * 2e-6 + wire / (450e9 * 0.8)


def at_the_previous_rate(scenario, monkeypatch):
    """The run's logs, each compute span re-timed at the previous clock's rate (0.5 x peak;
    the clock now computes at the in-step GEMM rate, tests/test_clock_rate.py) from the FLOPs
    it logged, replayed with the previous collective prices: the events placed as the run
    placed them, so the pins check where the run's clock puts every event
    (test_each_ranks_log_replays_to_its_timeline)."""
    previous = 0.5 * hardware.gpu("H100").bf16_flops
    logs = {r: [e[:3] + (e[4] / previous,) + e[4:] if e[0] == "span" and e[1] == "compute"
                else e for e in out["log"]] for r, out in enumerate(scenario)}
    monkeypatch.setattr(ttime, "collective_time", previous_collective_time)
    clocks = replay(logs)
    return [dict(now=clocks[r].now(), steps=clocks[r].step_times(),
                 events=[(e["lane"], e["kind"], e["name"], e["start"], e["end"])
                         for e in clocks[r].timeline()]) for r in range(len(scenario))]


def test_modelled_times_are_those_of_the_previous_clock(scenario, monkeypatch):
    assert all(e[4] > 0 for out in scenario for e in out["log"]
               if e[0] == "span" and e[1] == "compute")       # every span logged its FLOPs
    for got, pinned in zip(at_the_previous_rate(scenario, monkeypatch), PREVIOUS_CLOCK):
        assert got["now"] == pytest.approx(pinned["now"], rel=1e-12)
        assert got["steps"] == pytest.approx(pinned["steps"], rel=1e-12)
        assert [e[:3] for e in got["events"]] == [tuple(e[:3]) for e in pinned["events"]]
        assert [t for e in got["events"] for t in e[3:]] == pytest.approx(
            [t for e in pinned["events"] for t in e[3:]], rel=1e-12, abs=1e-18)


# --- the clock without stamps: payloads carry data only; the log replays to the same timeline --

TORCH_OPS = ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast",
             "all_to_all_single", "barrier", "send", "isend", "recv", "irecv")


def payload_bytes(ctx):
    """Every op with the clock on and the ranks late by different amounts; what torch got."""
    handed = []
    for name in TORCH_OPS:   # this rank's process only: record each call, then run it
        real = getattr(torch.distributed, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            handed.append((_name, [a.nbytes for a in args if isinstance(a, torch.Tensor)]))
            return _real(*args, **kwargs)
        setattr(torch.distributed, name, spy)
    r = ctx.rank
    ctx.clock.add_compute("late", (r + 1) * 1e11)
    x = torch.ones(6)
    ctx.comm.all_reduce(x)
    ctx.comm.all_reduce(torch.tensor([True, False]), op="max")   # no dtype is special now
    ctx.comm.all_reduce(torch.ones(4, dtype=torch.bfloat16), op="avg", async_op=True).wait()
    ctx.comm.all_gather(x)
    ctx.comm.reduce_scatter(x)
    ctx.comm.broadcast(x, src=1)
    ctx.comm.all_to_all(x)
    ctx.comm.barrier()
    sending = ctx.comm.send(x[:3], 1 - r, async_op=True)
    ctx.comm.recv(torch.zeros(3), 1 - r)
    sending.wait()
    return handed, ctx.clock.now()


def test_a_collective_sends_its_tensors_bytes_and_nothing_else():
    (handed, now0), (_, now1) = labkit.launch(payload_bytes, 2)
    assert handed == [("all_reduce", [24]), ("all_reduce", [2]), ("all_reduce", [8]),
                      ("all_gather_single", [48, 24]), ("reduce_scatter_single", [12, 24]),
                      ("broadcast", [24]), ("all_to_all_single", [24, 24]), ("barrier", []),
                      ("isend", [12]), ("recv", [12])]
    assert now0 == pytest.approx(now1) and now0 > 2e11 / H100_FLOP_S   # the clocks still met


def ring_all_reduce_s(nbytes):   # 2 ranks on NVLink 4: its measured all-reduce curve
    return ttime.collective_time("all_reduce", nbytes, 2, "NVLink 4")


def message_s(nbytes):
    return NVLINK_ALPHA + nbytes / NVLINK_B_S


def span(name, seconds):
    return ("span", "compute", name, seconds, 0, {}, 0.0, 0.0)


MS = 1e-3
HAND_WRITTEN = {   # rank -> its log, as Clock.log keeps it (op numbers count each rank's issues)
    0: [span("forward", 1 * MS), ("issue", "all_reduce", 4000, (0, 1), False, 0.0),
        ("wait", 0, 0.0), ("issue", "all_reduce", 1_000_000, (0, 1), True, 0.0),
        span("backward", 2 * MS), ("wait", 1, 0.0), ("step",),
        ("send", 1, 40_000, 0.0), span("between", 1 * MS), ("send", 1, 400, 0.0),
        ("wait", 2, 0.0), ("wait", 3, 0.0), ("step",)],
    1: [span("forward", 3 * MS), ("issue", "all_reduce", 4000, (0, 1), False, 0.0),
        ("wait", 0, 0.0), ("issue", "all_reduce", 1_000_000, (0, 1), True, 0.0),
        span("backward", 2 * MS), ("wait", 1, 0.0), ("step",),
        ("recv", 0, 40_000, 0.0), ("recv", 0, 400, 0.0), ("wait", 2, 0.0),
        ("wait", 3, 0.0), ("step",)],
}


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_replay_of_a_hand_written_log(order):
    clocks = replay({r: HAND_WRITTEN[r] for r in order})
    first_op = 3 * MS   # the sync all-reduce starts when the later member issues it
    after = first_op + ring_all_reduce_s(4000)
    for r, clock in clocks.items():
        sync = next(e for e in clock.events if e.name == "all_reduce" and e.lane == "compute")
        assert (sync.start, sync.end) == pytest.approx((first_op, after), rel=1e-12)
        lane = next(e for e in clock.events if e.lane == "comm" and e.kind == "comm")
        assert lane.start == pytest.approx(after)     # async: on the comm lane, under backward
        assert lane.end == pytest.approx(after + ring_all_reduce_s(1_000_000))
        assert lane.meta["exposed_s"] == 0 and lane.meta["hidden_s"] == pytest.approx(
            lane.end - lane.start)
        assert clock.step_times()[0] == pytest.approx(after + 2 * MS)
    idle = [e for e in clocks[0].events if e.kind == "idle"]
    assert [(e.start, e.end) for e in idle][0] == pytest.approx((1 * MS, 3 * MS))
    # the k-th recv from a rank is its k-th send: the 40 kB one, then the 400 B one a ms later
    sent = after + 2 * MS
    recvs = [e for e in clocks[1].events if e.kind == "recv"]
    assert [t for e in recvs for t in (e.start, e.end)] == pytest.approx(
        [sent, sent + message_s(40_000), sent + MS, sent + MS + message_s(400)], rel=1e-12)
    assert clocks[1].t == pytest.approx(sent + MS + message_s(400))
    assert clocks[0].t == pytest.approx(sent + MS)   # a sender does not wait for the transfer


def test_a_log_that_cannot_have_run_is_refused():
    deadlock = {r: [("recv", 1 - r, 8, 0.0), ("wait", 0, 0.0)] for r in (0, 1)}
    with pytest.raises(ValueError, match="cannot have run"):
        replay(deadlock)


def test_each_ranks_log_replays_to_its_timeline(scenario):
    clocks = replay({r: out["log"] for r, out in enumerate(scenario)})
    for r, out in enumerate(scenario):
        assert [(e.lane, e.kind, e.name, e.start, e.end) for e in clocks[r].events] == \
            out["events"]
        assert clocks[r].step_times() == out["steps"]



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
