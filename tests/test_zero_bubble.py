"""Zero-bubble pipelines (Qi et al. 2023): ZB-H1 as schedule data, its bubble against the paper's
formula and a hand count, its activation memory against 1F1B, the checks on W ops."""
import pytest

from labkit.theory import pipeline as pp

TIMES = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.2, 0.8), (2.0, 1.5, 0.25)]


@pytest.mark.parametrize("p, m", [(2, 2), (3, 6), (4, 4), (4, 8), (8, 24)])
def test_zb_h1_runs_every_op_once_in_order(p, m):
    schedule = pp.zb_h1_schedule(p, m)
    assert pp.check_schedule(schedule) == (p, m, 1)
    assert all(len(ops) == 3 * m for ops in schedule)


@pytest.mark.parametrize("p, m", [(2, 2), (3, 6), (4, 4), (4, 8), (8, 24)])
@pytest.mark.parametrize("times", TIMES)
def test_zb_h1_bubble_is_the_papers_and_below_1f1b(p, m, times):
    t_f, t_b, t_w = times
    zb = pp.timeline_bubble_fraction(pp.simulate_schedule(pp.zb_h1_schedule(p, m), t_f, t_b,
                                                          t_weight=t_w))
    assert zb == pytest.approx(pp.split_bubble_formula(p, m, t_f, t_b, t_w))
    one_f_one_b = pp.timeline_bubble_fraction(
        pp.simulate_schedule(pp.one_f_one_b_schedule(p, m), t_f, t_b + t_w))
    assert one_f_one_b == pytest.approx(pp.bubble_formula(p, m))
    assert zb < one_f_one_b


def test_zb_h1_bubble_by_hand():
    """P=4, M=8, T_F = T_B = T_W = 1: each rank works 24 units and idles (P-1)(1+1-1) = 3
    (1F1B: 3 x 3 = 9), so the bubble is 3/27 against 9/33."""
    zb = pp.simulate_schedule(pp.zb_h1_schedule(4, 8), 1, 1, t_weight=1)
    assert pp.timeline_bubble_fraction(zb) == pytest.approx(3 / 27)
    assert max(e["end"] for e in zb) == pytest.approx(27)
    one_f_one_b = pp.simulate_schedule(pp.one_f_one_b_schedule(4, 8), 1, 2)
    assert pp.timeline_bubble_fraction(one_f_one_b) == pytest.approx(9 / 33)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 8), (4, 2)])
def test_zb_h1_keeps_1f1b_activation_memory(p, m):
    zb, base = pp.zb_h1_schedule(p, m), pp.one_f_one_b_schedule(p, m)
    until_b = [pp.microbatches_in_flight(ops, until="B") for ops in zb]
    assert until_b == [pp.microbatches_in_flight(ops) for ops in base]     # rank by rank
    until_w = [pp.microbatches_in_flight(ops) for ops in zb]              # W keeps the inputs
    assert max(until_w) == max(pp.microbatches_in_flight(ops) for ops in base)


def test_w_ops_are_checked():
    good = pp.zb_h1_schedule(2, 2)
    bad = [list(good[0]), list(good[1])]
    w = bad[1].index(("W", 0, 0))
    bad[1].insert(0, bad[1].pop(w))
    with pytest.raises(ValueError, match="W0.0 before B0.0"):
        pp.check_schedule(bad)
    with pytest.raises(ValueError, match="never runs W1.0"):
        pp.check_schedule([good[0], [op for op in good[1] if op != ("W", 1, 0)]])
    with pytest.raises(ValueError, match="pass t_weight"):
        pp.simulate_schedule(good, 1, 1)
    assert pp.messages_to(good, 0) == pp.messages_to(pp.one_f_one_b_schedule(2, 2), 0)
