"""Lesson 07's checker: it names the bug (summed, not synchronised, not written, one-sided
collective) in words and passes the right answer."""
import pytest

from labkit.exercises import when_it_breaks as wib


def no_sync(ctx, model):
    pass


def stub(ctx, model):
    raise NotImplementedError("your code here")


def rank0_only(ctx, model):
    if ctx.rank == 0:
        for p in model.parameters():
            ctx.comm.all_reduce(p.grad)


def averaged_by_op(ctx, model):
    for p in model.parameters():
        ctx.comm.all_reduce(p.grad, op="avg")


def half_step(ctx, model):
    wib.average_gradients(ctx, model)
    for p in model.parameters():
        p.grad /= 2


@pytest.mark.parametrize("fn", [wib.average_gradients, averaged_by_op])
def test_right_answers_pass(fn):
    check = wib.check_gradient_sync(fn, verbose=False)
    assert check.ok and check.problem == "" and check.message.startswith("CORRECT")


@pytest.mark.parametrize("fn, problem, words", [
    (wib.sum_gradients, "summed", "2.00x the single-device"),
    (no_sync, "replicas differ", "drift apart"),
    (stub, "not written", "NotImplementedError"),
    (half_step, "wrong result", "0.50x"),
])
def test_wrong_answers_fail_with_their_reason(fn, problem, words):
    check = wib.check_gradient_sync(fn, verbose=False)
    assert not check.ok and check.problem == problem
    assert words in check.message and "Hint:" in check.message


def test_summed_on_four_ranks_says_four():
    check = wib.check_gradient_sync(wib.sum_gradients, world_size=4, verbose=False)
    assert check.problem == "summed" and "4.00x" in check.message


def test_a_collective_on_one_rank_only_is_named():
    check = wib.check_gradient_sync(rank0_only, timeout_s=5, verbose=False)
    assert not check.ok and check.problem in ("one-sided collective", "deadlock")
    assert "same collectives in the same order" in check.message


def test_the_checker_reports_and_returns_without_raising(capsys):
    check = wib.check_gradient_sync(wib.sum_gradients)
    assert capsys.readouterr().out.strip() == check.message
