"""Schedules on other stage layouts (theory.pipeline_layouts): DualPipe as data against the
DeepSeek-V3 report's Table 2 (bubble, activations, parameters), the layout simulator against
labkit's own on the looped layout, the checks; torch.distributed.pipelining's ZBV and DualPipeV
orders converted to labkit data and replayed."""
import pytest

from labkit.theory import pipeline as pp
from labkit.theory import pipeline_layouts as lay

SHAPES = [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16), (8, 20)]
EQUAL_F_B = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 2.0, 0.25)]       # T_F = T_B, any T_W
UNEQUAL = [(1.0, 1.2, 0.8), (2.0, 1.5, 0.25), (1.0, 2.0, 0.5)]


@pytest.mark.parametrize("p, m", SHAPES)
def test_dualpipe_runs_every_op_once_in_order(p, m):
    sched = lay.dualpipe_schedule(p, m)
    lay.check_laid_out(sched)              # F before B before W, each once, no deadlock
    for rank, ops in enumerate(sched.ops):
        forwards = [(mb, c) for kind, mb, c in ops if kind == "F"]
        assert len(forwards) == m          # every micro-batch, one of two directions
        assert {c for mb, c in forwards if mb < m // 2} == {0}
        assert {c for mb, c in forwards if mb >= m // 2} == {1}


def test_dualpipe_holds_each_stage_twice():
    """Parameters 2x: stage s is on ranks s (chunk 0) and P-1-s (chunk 1)."""
    p = 6
    holders = {}
    for m in (0, 6):                       # one micro-batch from each end
        for s, (rank, chunk) in enumerate(lay.route("dual", p, 12, m)):
            holders.setdefault(s, set()).add((rank, chunk))
    assert holders == {s: {(s, 0), (p - 1 - s, 1)} for s in range(p)}


@pytest.mark.parametrize("p, m", SHAPES)
@pytest.mark.parametrize("times", EQUAL_F_B)
def test_dualpipe_idle_is_table_2s_when_forward_equals_input_grad(p, m, times):
    idle = lay.idle_per_rank(lay.simulate_laid_out(lay.dualpipe_schedule(p, m), *times))
    assert idle == pytest.approx([lay.table2_idle("dualpipe", p, *times)] * p)


@pytest.mark.parametrize("p, m", [(4, 8), (6, 16), (8, 20)])
def test_dualpipe_off_table_2_when_forward_and_input_grad_differ(p, m):
    """Table 2's DualPipe formula is exact for T_F = T_B only: the replayed order idles less
    when T_B > T_F, more when T_F > T_B (what labkit finds; the report gives no derivation)."""
    for t_f, t_b, t_w in [(1.0, 1.5, 0.5), (0.6, 1.8, 0.3), (1.5, 1.0, 0.5), (2.0, 0.8, 0.4)]:
        idle = max(lay.idle_per_rank(lay.simulate_laid_out(lay.dualpipe_schedule(p, m), t_f,
                                                           t_b, t_w)))
        table = lay.table2_idle("dualpipe", p, t_f, t_b, t_w)
        assert (idle < table) if t_b > t_f else (idle > table)


@pytest.mark.parametrize("p", [4, 6, 8])
@pytest.mark.parametrize("times", EQUAL_F_B + UNEQUAL)
def test_dualpipe_idles_less_than_zb_h1_and_1f1b(p, times):
    t_f, t_b, t_w = times
    dual = max(lay.idle_per_rank(lay.simulate_laid_out(lay.dualpipe_schedule(p, 2 * p),
                                                       *times)))
    zb = lay.idle_per_rank(pp.simulate_schedule(pp.zb_h1_schedule(p, 2 * p), *times[:2],
                                                t_weight=t_w))
    assert max(zb) == pytest.approx(lay.table2_idle("zb1p", p, *times))
    base = lay.idle_per_rank(pp.simulate_schedule(pp.one_f_one_b_schedule(p, 2 * p), t_f,
                                                  t_b + t_w))
    assert max(base) == pytest.approx(lay.table2_idle("1f1b", p, *times))
    assert dual < max(zb) < max(base)


def test_dualpipe_idle_by_hand():
    """P=4, M=8, T_F = T_B = T_W = 1: each rank works 8 x 3 = 24. Rank 0 waits one unit
    twice, at its F&B slots with B0 and B1: rank 1 sends those input gradients after its full
    backwards (B and W, 2 units). The step takes 26: (P/2-1)(F&B + B - 3W) = 1 x (3+2-3)."""
    timeline = lay.simulate_laid_out(lay.dualpipe_schedule(4, 8), 1, 1, 1)
    assert max(e["end"] for e in timeline) == pytest.approx(26)
    assert lay.idle_per_rank(timeline) == pytest.approx([2, 2, 2, 2])


@pytest.mark.parametrize("p", [2, 4, 8])
def test_dualpipe_activations_are_table_2s(p):
    """P+1 micro-batch stages held at the peak, on every rank (1F1B: P, on its first)."""
    assert lay.activations_held(lay.dualpipe_schedule(p, 2 * p)) == [p + 1] * p
    base = lay.from_loop(pp.one_f_one_b_schedule(p, 2 * p))
    assert max(lay.activations_held(base, until="B")) == p


@pytest.mark.parametrize("name, make", [("zb-h1", lambda: pp.zb_h1_schedule(4, 8)),
                                        ("1f1b", lambda: pp.one_f_one_b_schedule(4, 8)),
                                        ("interleaved",
                                         lambda: pp.interleaved_schedule(4, 8, 2))])
def test_layout_simulator_equals_labkits_on_the_loop(name, make):
    schedule = make()
    mine = lay.simulate_laid_out(lay.from_loop(schedule), 1.0, 1.5, 0.5)
    if pp.is_split(schedule):
        theirs = pp.simulate_schedule(schedule, 1.0, 1.5, t_weight=0.5)
    else:                                   # a full backward: B + W
        theirs = pp.simulate_schedule(schedule, 1.0, 2.0)
    assert max(e["end"] for e in mine) == pytest.approx(max(e["end"] for e in theirs))
    assert lay.idle_per_rank(mine) == pytest.approx(lay.idle_per_rank(theirs))


def test_bad_layouts_are_refused():
    good = lay.dualpipe_schedule(4, 8)
    ops = [list(o) for o in good.ops]
    w = ops[1].index(("W", 0, 0))
    ops[1].insert(0, ops[1].pop(w))
    with pytest.raises(ValueError, match="W0.0 before B0.0"):
        lay.check_laid_out(good._replace(ops=ops, slots=()))
    with pytest.raises(ValueError, match="never runs"):
        lay.check_laid_out(good._replace(ops=[good.ops[0][:-1]] + good.ops[1:]))
    late = [list(o) for o in good.ops]
    late[0].remove(("F", 0, 0))
    late[0].append(("F", 0, 0))                    # F0 after its B0
    with pytest.raises(ValueError, match="B0.0 before F0.0"):
        lay.check_laid_out(good._replace(ops=late, slots=()))
    stuck = [list(o) for o in good.ops]
    stuck[3].remove(("F", 0, 0))
    stuck[3].insert(0, ("F", 0, 0))                # before F4, which rank 2 waits for
    with pytest.raises(ValueError, match="deadlock"):
        lay.check_laid_out(good._replace(ops=stuck, slots=()))
    with pytest.raises(ValueError, match="even M >= 2P"):
        lay.dualpipe_schedule(4, 6)
    with pytest.raises(ValueError, match="even number of ranks"):
        lay.dualpipe_schedule(3, 12)


# ------------------------------------------------------------------ torch's own orders

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
zero_bubble = pytest.importorskip("labkit.parallel.zero_bubble")
HAS_V = all(hasattr(torch_schedules, n) for n in zero_bubble.TORCH_V_SCHEDULES)


@pytest.mark.skipif(not HAS_V, reason="this torch has no ScheduleZBVZeroBubble/DualPipeV")
@pytest.mark.parametrize("name", zero_bubble.TORCH_V_SCHEDULES)
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_torch_orders_run_on_the_v(name, p, m):
    sched = zero_bubble.torch_order(name, p, m)
    lay.check_laid_out(sched)
    half = [t / 2 for t in (1.0, 1.0, 0.5)]       # a V chunk is half a stage
    idle = lay.idle_per_rank(lay.simulate_laid_out(sched, *half))
    assert max(idle) - min(idle) == pytest.approx(0)
    zb = lay.idle_per_rank(pp.simulate_schedule(pp.zb_h1_schedule(p, m), 1.0, 1.0,
                                                t_weight=0.5))
    assert max(idle) < max(zb)               # the V: half the ramp of ZB-H1


@pytest.mark.skipif(not HAS_V, reason="this torch has no ScheduleZBVZeroBubble")
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 24)])
def test_torch_zbv_idles_only_the_ramp_when_times_are_equal(p, m):
    """T_F = T_B = T_W: each rank idles exactly what rank P-1 waits before its first op (the
    first micro-batch's way down the V), which no order avoids: zero bubble but the ramp."""
    timeline = lay.simulate_laid_out(zero_bubble.torch_order("ScheduleZBVZeroBubble", p, m),
                                     0.5, 0.5, 0.5)
    ramp = min(e["start"] for e in timeline if e["rank"] == p - 1 and e["kind"] == "compute")
    assert ramp > 0
    assert lay.idle_per_rank(timeline) == pytest.approx([ramp] * p)


@pytest.mark.skipif(not HAS_V, reason="this torch has no ScheduleDualPipeV")
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("times", EQUAL_F_B)
def test_torch_dualpipev_idle_is_dualpipes_on_2p_half_stages(p, times):
    """DualPipeV is DualPipe folded: P ranks, 2P half stages, Table 2's DualPipe with 2P."""
    half = [t / 2 for t in times]
    sched = zero_bubble.torch_order("ScheduleDualPipeV", p, 2 * p)
    idle = lay.idle_per_rank(lay.simulate_laid_out(sched, *half))
    assert idle == pytest.approx([lay.table2_idle("dualpipe", 2 * p, *half)] * p)


# ------------------------------------------------------------------ the explorer (lesson 02)

def test_zero_bubble_explorer_redraws_in_place():
    import matplotlib.pyplot as plt
    from labkit.viz import zero_bubble_widgets as zbw

    open_before = set(plt.get_fignums())   # other tests may leave pyplot figures open
    box = zbw.zero_bubble_explorer()
    controls = {w.description: w for row in box.children[:-2] for w in row.children
                if hasattr(w, "description")}
    gantt_ax, mem_ax = box.figure.axes
    before = box.image.value
    controls["stages P"].value = 5                  # DualPipe: moved to P = 6, M = 12
    assert [t.get_text() for t in gantt_ax.get_yticklabels()] == [f"rank {r}" for r in range(6)]
    assert "P = 6, M = 12" in box.text.value and box.image.value != before
    assert sum(bar.get_visible() for bar in mem_ax.patches) == 6
    controls["schedule"].value = "ZB-H1"            # ZB-H1 runs P = 5 as it is
    assert len(gantt_ax.get_yticklabels()) == 5
    numbers = zbw.zero_bubble_numbers("ZB-H1", 5, 8, 0.5)
    assert f"{max(lay.idle_per_rank(numbers['timeline'])) * 1e3:.2f} ms" in box.text.value
    assert set(plt.get_fignums()) == open_before    # the explorer opens no pyplot figure
