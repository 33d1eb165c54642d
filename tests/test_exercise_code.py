"""The code exercises' checkers against plausible wrong answers (tests/wrong_answers.py): each
is named for its own mistake, a first miss gets the concept and a second the code; right values
by a wasteful method are told apart by the lab's instruments (the comm log, the FLOP counter);
and whatever a learner hands in is answered in one line, never raised."""
import pytest
import torch
from wrong_answers import (all_reduce_then_slice, blocking_ring, blocking_ring_attention,
                           decode_without_cache, detached_row_parallel, gathered_ring_attention,
                           row_parallel_float64, row_parallel_returns_none, summed_shard,
                           summed_sync, world_average)


def test_zero2_shard_by_all_reduce_then_slice_is_rejected_for_its_bytes():
    from labkit.exercises import zero
    check = zero.check_gradient_shard(all_reduce_then_slice, timeout_s=60, verbose=False)
    assert not check.ok and check.problem == "too many bytes", check.message
    assert "RIGHT VALUES, TOO MANY BYTES" in check.message and "all_reduce" in check.message
    assert "whole averaged gradient" in check.message and "(N-1)/N x S" in check.message


def test_a_valid_order_that_is_not_1f1b_is_called_valid_and_told_what_1f1b_changes():
    from labkit.exercises.pipeline import check_stage_order
    ops = ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "F6", "B4", "F7", "B5",
           "B6", "B7"]                               # 3 forwards before the first backward
    check = check_stage_order(ops, verbose=False)
    assert not check.ok and check.problem == "not 1F1B", check.message
    assert "VALID, BUT NOT 1F1B" in check.message and "same parameters" in check.message
    assert "runs 3 forwards" in check.message and "P - stage = 4" in check.message
    yours, ideal = (float(x) for x in
                    check.message.split("bubble drops from your ")[1].split(" (")[0].split(" to "))
    assert ideal < yours


@pytest.mark.parametrize("lesson", ["01", "08"])
def test_blocking_sends_are_said_to_deadlock_in_send(lesson):
    from labkit.exercises import context_parallel as cp, data_parallel as dp
    check = (dp.check_ring_all_reduce(blocking_ring, timeout_s=20, verbose=False)
             if lesson == "01" else     # 20 s: time for every rank to reach its send under load
             cp.check_ring_attention(blocking_ring_attention, timeout_s=20, verbose=False))
    assert not check.ok and check.problem == "deadlock", check.message
    assert "Every rank waits in send" in check.message and "async_op=True" in check.message
    assert "waits in recv" not in check.message


def test_the_deadlock_words_follow_the_op_the_ranks_are_in():
    from labkit.exercises import deadlock_in_words, ranks_waiting_in
    text = ("timed out after 5s; ranks still running and where they wait:\n"
            "  rank 0: recv from rank 1 (16 bytes) \n  rank 1: send to rank 0 (16 bytes) \n")
    assert ranks_waiting_in(text) == {0: "recv", 1: "send"}
    assert "in send and in recv" in deadlock_in_words(text)
    assert "Every rank waits in recv" in deadlock_in_words(text.replace("send to", "recv from"))
    assert "more time" in deadlock_in_words("timed out after 5s: still computing")


def test_a_launch_too_slow_to_start_is_not_blamed_on_the_code():
    from labkit.exercises import SLOW, too_slow_to_start, when_it_breaks as wib
    slow = ("timed out after 20s: still computing, no rank waits in a collective (ranks 0, 1 "
            "are busy in fn).")
    assert too_slow_to_start(slow) and not too_slow_to_start("timed out after 20s; ranks ...")
    check = wib._failed_run(slow)
    assert check.problem == "slow" and check.message == SLOW and "timeout_s=60" in SLOW


def test_ranks_that_could_not_connect_are_not_blamed_on_the_code():
    from labkit.exercises import NO_MESH, context_parallel as cp, data_parallel as dp
    from labkit.exercises import when_it_breaks as wib, why_parallelism as why
    text = ("rank 1 raised: RuntimeError: Gloo connectFullMesh failed with [pair.cc:553] "
            "Connection closed by peer")
    for check in (wib._failed_run(text), why._failed(text), dp._failed_run(text, 20),
                  cp._ring_failed(text)):
        assert check.problem == "slow" and check.message == NO_MESH
    assert why._failed("rank 1 raised: ValueError: mine").problem == "raised"


def _second_failure_shows_code(run, code_words):
    first, second = run(), run()
    assert not first.ok and not second.ok
    assert "Hint:" in first.message and code_words not in first.message, first.message
    assert "show_solution()" in first.message
    assert "The code:" in second.message and code_words in second.message, second.message


def test_zero2_shard_hints_first_and_shows_the_code_second():
    from labkit.exercises import zero
    def run():
        return zero.check_gradient_shard(summed_shard, timeout_s=60, verbose=False)
    _second_failure_shows_code(run, "reduce_scatter(grad)")


def test_dp_average_hints_first_and_shows_the_code_second():
    from labkit.exercises import hybrid
    def run():
        return hybrid.check_dp_average(world_average, timeout_s=60, verbose=False)
    _second_failure_shows_code(run, "group=mesh['dp']")
    assert run().problem == "world"


def test_gradient_sync_hints_first_and_shows_the_code_second():
    from labkit.exercises import when_it_breaks as wib
    _second_failure_shows_code(lambda: wib.check_gradient_sync(summed_sync, verbose=False),
                               "p.grad /= ctx.world_size")


def test_merge_hints_first_and_shows_the_code_second(capsys):
    from labkit.exercises import context_parallel as cp

    def averaged(out_a, lse_a, out_b, lse_b):
        return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)
    _second_failure_shows_code(lambda: cp.check_merge(averaged, verbose=False), "logaddexp")
    cp.show_solution()
    assert "torch.logaddexp" in capsys.readouterr().out


# ------------------------------- right values by a wasteful method, told apart by the instruments

def test_decoding_without_a_cache_is_told_by_its_counted_flops():
    from labkit.exercises import serving
    check = serving.check_tp_decode_step(decode_without_cache, verbose=False)
    assert not check.ok and check.problem == "no cache", check.message
    assert "RIGHT VALUES, NO CACHE" in check.message and "FLOP counter" in check.message
    counted, cached = (float(w.replace(",", "")) for w in
                       check.message.split("ran ")[1].split(" FLOPs")[0:1]
                       + [check.message.split("x the ")[1].split(" of a step")[0]])
    assert counted > 1.5 * cached


def test_an_all_gather_of_k_and_v_is_not_a_ring_by_the_comm_log():
    from labkit.exercises import context_parallel as cp
    check = cp.check_ring_attention(gathered_ring_attention, verbose=False)
    assert not check.ok and check.problem == "not a ring", check.message
    assert "RIGHT VALUES, NOT A RING" in check.message and "all_gather" in check.message
    assert "sent 0 bytes" not in check.message and "all 4 K, V blocks" in check.message


@pytest.mark.parametrize("fn, problem", [(detached_row_parallel, "detached"),
                                         (row_parallel_returns_none, "not a tensor"),
                                         (row_parallel_float64, "")])
def test_row_parallel_answers_a_detached_or_odd_result_in_one_line(fn, problem):
    from labkit.exercises import tensor_parallel as tp
    check = tp.check_row_parallel(fn, verbose=False)
    assert check.problem == problem and check.ok == (problem == ""), check.message
    assert "\n" not in check.message


def test_every_code_checker_answers_a_non_function_in_one_line():
    from labkit.exercises import context_parallel as cp, data_parallel as dp, hybrid, moe
    from labkit.exercises import serving, tensor_parallel as tp, when_it_breaks as wib
    from labkit.exercises import why_parallelism as why, zero
    for checker in (why.check_broadcast, dp.check_ring_all_reduce, tp.check_row_parallel,
                    zero.check_gradient_shard, moe.check_top_k_routing, hybrid.check_dp_average,
                    wib.check_gradient_sync, cp.check_merge, cp.check_ring_attention,
                    serving.check_tp_decode_step):
        for answer in (None, 3, "my_fn"):
            check = checker(answer, verbose=False)
            assert check.problem == "not a function" and "\n" not in check.message, checker


def test_the_routing_checker_answers_odd_returns_in_one_line():
    from labkit.exercises import moe
    for fn, problem in ((lambda logits, k, c: None, "not a triple"),
                        (lambda logits, k, c: (logits, logits, logits), "shape"),
                        (lambda logits, k, c: logits.topk(k, -1)[::-1] + (None,),
                         "not a triple")):
        check = moe.check_top_k_routing(fn, verbose=False)
        assert not check.ok and check.problem == problem, check.message


def test_the_merge_checker_answers_odd_returns_in_one_line():
    from labkit.exercises import context_parallel as cp
    for fn in (lambda *a: (a[0].double(), a[1].double()),):          # right, in float64
        assert cp.check_merge(fn, verbose=False).problem != "error"
    check = cp.check_merge(lambda *a: (a[0].long(), a[1].long()), verbose=False)
    assert not check.ok and check.problem == "shape" and "floating point" in check.message


# ------------------------------------------- code exercises: a catalog of wrong answers each

def _code_cases():
    from wrong_answers import code_catalog
    return [(ex, name, fn, problem) for ex, (name, answers) in code_catalog().items()
            for fn, problem in answers]


@pytest.mark.parametrize("exercise, checker, fn, problem", _code_cases(),
                         ids=[f"{e}-{p}" for e, _, _, p in _code_cases()])
def test_each_wrong_code_answer_is_named_for_its_mistake(exercise, checker, fn, problem):
    import importlib
    module, name = checker.split(".")
    check = getattr(importlib.import_module(f"labkit.exercises.{module}"), name)(
        fn, verbose=False)
    assert not check.ok and check.problem == problem, (problem, check.message)
    assert "Hint:" in check.message            # a first miss: the concept, not the code
    assert "The code:" not in check.message


def _router(logits, k, capacity, renormalise=True, largest=True, flip=False, by_token=False):
    probs = logits.softmax(-1)
    weight, expert = probs.topk(k, -1, largest=largest)
    if renormalise and k > 1:
        weight = weight / weight.sum(-1, keepdim=True)
    if flip:
        weight, expert = weight.flip(-1), expert.flip(-1)
    kept, used = torch.zeros_like(expert, dtype=torch.bool), [0] * logits.shape[-1]
    order = ([(t, c) for t in range(len(logits)) for c in range(k)] if by_token else
             [(t, c) for c in range(k) for t in range(len(logits))])
    for t, c in order:
        e = int(expert[t, c])
        if capacity is None or used[e] < capacity:
            kept[t, c], used[e] = True, used[e] + 1
    return expert, weight, kept


@pytest.mark.parametrize("options, problem", [
    (dict(), ""), (dict(renormalise=False), "weights"), (dict(largest=False), "experts"),
    (dict(flip=True), "choice order"), (dict(by_token=True), "drop order")])
def test_routing_mistakes_are_named(options, problem):
    from labkit.exercises import moe
    check = moe.check_top_k_routing(lambda lg, k, c: _router(lg, k, c, **options), verbose=False)
    assert check.problem == problem and check.ok == (not problem), check.message
    never_drops = moe.check_top_k_routing(lambda lg, k, c: _router(lg, k, None), verbose=False)
    assert never_drops.problem == "capacity", never_drops.message


@pytest.mark.parametrize("ops, problem", [
    (None, "no answer"), (["X0"], "unreadable"),
    ([f"F{i}" for i in range(8)] + [f"B{i}" for i in range(8)], "memory"),
    (["F0", "B0"] + [f"F{i}" for i in range(1, 8)] + [f"B{i}" for i in range(1, 8)],
     "deadlock"),
    ([f"F{i}" for i in range(8)] + [f"B{i}" for i in range(7)], "malformed")])
def test_stage_order_mistakes_are_named(ops, problem):
    from labkit.exercises.pipeline import check_stage_order
    check = check_stage_order(ops, verbose=False)
    assert not check.ok and check.problem == problem, check.message


@pytest.mark.parametrize("layout, problem", [
    (dict(tp=8, pp=12), "not answered"), (dict(dp=8, tp=8, pp=2), "illegal"),
    (dict(dp=96, tp=1, pp=1, zero_stage=0), "does not fit"),
    (dict(dp=1, tp=8, pp=12), "too slow")])   # one replica of 12 stages: the bubble
def test_layout_mistakes_are_named(layout, problem):
    from labkit.exercises.hybrid import check_layout
    check = check_layout(layout, verbose=False)
    assert not check.ok and check.problem == problem, check.message


def test_merge_mistakes_are_named():
    from labkit.exercises import context_parallel as cp

    def naive(out_a, lse_a, out_b, lse_b):          # exp of an lse: overflows
        sa, sb = lse_a.exp(), lse_b.exp()
        out = (sa[..., None] * out_a + sb[..., None] * out_b) / (sa + sb)[..., None]
        return out, (sa + sb).log()

    def stale_lse(out_a, lse_a, out_b, lse_b):
        lse = torch.logaddexp(lse_a, lse_b)
        return (torch.exp(lse_a - lse)[..., None] * out_a
                + torch.exp(lse_b - lse)[..., None] * out_b), lse_a

    def nan_when_unseen(out_a, lse_a, out_b, lse_b):
        lse = torch.logaddexp(lse_a, lse_b)
        return (torch.exp(lse_a - lse)[..., None] * out_a
                + torch.exp(lse_b - lse)[..., None] * out_b), lse
    for fn, problem in ((naive, "overflow"), (stale_lse, "lse"),
                        (nan_when_unseen, "masked"),
                        (lambda a, la, b, lb: ((a + b) / 2, torch.logaddexp(la, lb)),
                         "average")):
        check = cp.check_merge(fn, verbose=False)
        assert not check.ok and check.problem == problem, (problem, check.message)


@pytest.mark.parametrize("checker, fn", [
    ("why_parallelism.check_broadcast", lambda ctx, tensor: tensor.long()),
    ("data_parallel.check_ring_all_reduce", lambda ctx, tensor: tensor.long()),
    ("hybrid.check_dp_average", lambda ctx, mesh, grad: grad.long()),
    ("zero.check_gradient_shard", lambda ctx, grad: grad.long())])
def test_an_integer_result_is_judged_not_raised(checker, fn):
    import importlib
    module, name = checker.split(".")
    check = getattr(importlib.import_module(f"labkit.exercises.{module}"), name)(
        fn, verbose=False)
    assert not check.ok and check.problem not in ("error", "raised"), check.message
