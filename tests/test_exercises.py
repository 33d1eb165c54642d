"""Every lesson's exercises, as the two editions give them: each answer cell (tagged `solution`)
is followed by the cell that checks it; the instructor's answer passes its checker, the student
edition's stub fails it with the message a learner should read; and each number checker names
the likely wrong answers (a forgotten factor, bits for bytes, GB for bytes, percent).

Checker cells are run as the notebook runs them (the lesson's import cell, then its answer
cells, then the checking cell's last expression), with the feedback printing silenced."""
import ast
import contextlib
import io
import math

import nbformat
import pytest
import torch
from wrong_answers import (all_reduce_then_slice, blocking_ring, blocking_ring_attention,
                           summed_shard, summed_sync, world_average)

from labkit import editions
from labkit.theory import catalog

LESSONS = ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10"]

# What the student edition's stub of each exercise must make its checker say, in order.
STUB_SAYS = {
    "00": ["NOT WRITTEN YET", "No answer yet", "No answer yet"],
    "01": ["NOT WRITTEN YET", "No answer yet"],
    "02": ["No answer yet", "No answer yet", "No answer yet"],
    "03": ["NOT WRITTEN YET", "No answer yet", "No answer yet"],
    "04": ["NOT WRITTEN YET", "No answer yet", "No answer yet"],
    "05": ["NOT WRITTEN YET", "No answer yet"],
    "06": ["NOT WRITTEN YET", "Give a dict with at least dp, tp and pp", "No answer yet"],
    "07": ["NOT WRITTEN YET", "No answer yet"],
    "08": ["NOT WRITTEN YET", "NOT WRITTEN YET", "No answer yet"],
    "09": ["NOT WRITTEN YET", "No answer yet", "No answer yet"],
    "10": ["NOT WRITTEN YET", "No answer yet", "No answer yet"],
}


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    with contextlib.redirect_stdout(io.StringIO()):
        editions.build_student(out)
    return out


def read(folder, prefix):
    path = next(p for p in editions.lessons(folder) if p.name.startswith(prefix + "_"))
    return nbformat.read(path, as_version=4)


def exercises(nb):
    """(answer cell, checking cell) pairs: each solution cell and the code cell after it."""
    cells = nb.cells
    return [(cell, cells[i + 1]) for i, cell in enumerate(cells)
            if "solution" in cell.metadata.get("tags", [])]


def run_checks(nb):
    """The Check of every exercise, run as the notebook runs: imports, answers, checker."""
    ns, checks = {}, []
    imports = next(c for c in nb.cells if c.cell_type == "code")
    with contextlib.redirect_stdout(io.StringIO()):
        exec(imports.source, ns)
        for answer, checker in exercises(nb):
            exec(answer.source, ns)
            tree = ast.parse(checker.source)
            *before, last = tree.body
            exec(compile(ast.Module(before, []), "checker", "exec"), ns)
            if isinstance(last, ast.Assign):
                exec(compile(ast.Module([last], []), "checker", "exec"), ns)
                checks.append(ns[last.targets[0].id])
            else:
                checks.append(eval(compile(ast.Expression(last.value), "checker", "eval"), ns))
    return checks


@pytest.mark.parametrize("prefix", LESSONS)
def test_lesson_ends_with_exercises_checked_in_the_next_cell(prefix):
    nb = read(editions.NOTEBOOKS, prefix)
    pairs = exercises(nb)
    assert 1 <= len(pairs) <= 3 and len(pairs) == len(STUB_SAYS[prefix])
    first = nb.cells.index(pairs[0][0])
    assert any(c.cell_type == "markdown" and "## Exercises" in c.source
               for c in nb.cells[first - 3:first])
    assert all(checker.cell_type == "code" and "check" in checker.source
               for _, checker in pairs)
    later = nb.cells[first:]
    assert not any("## " in c.source for c in later if c.cell_type == "markdown"), \
        "no new section after the exercises"


@pytest.mark.parametrize("prefix", LESSONS)
def test_solutions_pass_and_stubs_fail_with_their_message(student, prefix):
    on_solution = run_checks(read(editions.NOTEBOOKS, prefix))
    on_stub = run_checks(read(student, prefix))
    for check, says in zip(on_solution, STUB_SAYS[prefix]):
        assert check.ok, check.message
    for check, says in zip(on_stub, STUB_SAYS[prefix]):
        assert not check.ok and says in check.message, check.message
        assert "False" != check.message.strip()


# ------------------------------------------------------------ number checkers name the mistake

def _gpt2_bf16_grads():
    return 2 * catalog.model("gpt2-small").param_count()


def _llama(name):
    return catalog.model(name).param_count()


def _wrong_answers():
    """(checker, likely wrong answer, the problem it must be named as, words in the message)."""
    from labkit.exercises import context_parallel as cp, data_parallel as dp, hybrid
    from labkit.exercises import moe, pipeline, tensor_parallel as tp, when_it_breaks as wib
    from labkit.exercises import serving_systems as ss, why_parallelism as why, zero
    from labkit.theory import hardware, roofline
    s, n = _gpt2_bf16_grads(), 16
    act = 1 * 4096 * 8192 * 2
    kv = 2 * 8 * (65536 // 16) * 128 * 2
    psi8, psi70 = _llama("llama-3-8b"), _llama("llama-3-70b")
    mfu = 6 * psi8 * 600_000 / (64 * hardware.gpu("H100").bf16_flops)
    return [
        (why.check_gb_no_zero, 2 * psi8 / 1e9, "weights only", "2 bytes per parameter"),
        (why.check_gb_no_zero, 16 * psi8, "units", "1 GB = 1e9 bytes"),
        (why.check_fewest_gpus_zero3, 1, "does not fit", "more than an H100"),
        (dp.check_ring_bytes, (n - 1) / n * s, "one phase", "once in reduce-scatter and once"),
        (dp.check_ring_bytes, 2 * s, "factor (N-1)/N", "(N-1)/N"),
        (dp.check_ring_bytes, 2 * (n - 1) / n * s * 8, "bits", "8 bits"),
        (dp.check_ring_bytes, 2 * (n - 1) / n * 2 * s, "fp32", "bf16"),
        (pipeline.check_gpipe_bubble, 5 / 20, "over ideal", "(P-1)/(M+P-1)"),
        (pipeline.check_gpipe_bubble, 100 * 5 / 25, "percent", "fraction"),
        (pipeline.check_dualpipe_idle, 7 * 2.5, "P-1", "P/2-1"),
        (pipeline.check_dualpipe_idle, 3 * 1.5, "input grad only", "full backward"),
        (pipeline.check_dualpipe_idle, 3 * 1, "F&B = F", "F + B"),
        (pipeline.check_dualpipe_idle, 7 * 1.5, "ZB-H1's", "Table 2"),
        (tp.check_block_bytes, 2 * 2 * 7 / 8 * act, "half the calls", "forward and backward"),
        (tp.check_block_bytes, 4 * act, "payload", "2(t-1)/t"),
        (moe.check_capacity_answer, math.floor(1.25 * 2 * 6000 / 64), "rounded down", "round up"),
        (moe.check_capacity_answer, math.ceil(1.25 * 6000 / 64), "forgot k", "k = 2"),
        (hybrid.check_hybrid_memory, 16 * psi70 / 32 / 1e9, "no ZeRO", "ZeRO-1"),
        (hybrid.check_hybrid_memory, 16 * psi70 / 8 / 1e9, "forgot pp", "tp x pp"),
        (hybrid.check_hybrid_memory, (2 + 4 + 12 / 2) * psi70 / 32 / 1e9, "fp32 gradients",
         "the planner's convention"),
        (wib.check_mfu_answer, mfu / 2, "sparse peak", "dense"),
        (wib.check_mfu_answer, mfu / 3, "forward only", "6 x params"),
        (wib.check_mfu_answer, mfu * 100, "percent", "fraction"),
        (cp.check_ring_bytes, 16 * kv, "one pass too many", "N-1"),
        (cp.check_ring_bytes, 15 * kv * 64 / 8, "query heads", "KV heads"),
        (cp.check_ring_bytes, 15 * kv, "", "Correct"),
        (zero.check_fsdp_critical_batch, roofline.critical_batch("dp", 64, "H100",
                                                                 "InfiniBand NDR"),
         "DP's bytes", "3(N-1)/N"),
        (zero.check_fsdp_critical_batch, roofline.critical_batch("fsdp", 64, "H100",
                                                                 "InfiniBand NDR") / 8,
         "bits", "8 bits"),
        (ss.check_requests_that_fit, 16384 // 300, "no rounding up", "ceil(300 / 16)"),
        (ss.check_requests_that_fit, 16384 // 4096, "contiguous", "reserving 4,096"),
    ]


@pytest.mark.parametrize("checker, answer, problem, words", _wrong_answers(),
                         ids=lambda v: v.__name__ if callable(v) else None)
def test_number_checkers_name_the_likely_mistake(checker, answer, problem, words):
    check = checker(answer, verbose=False)
    assert check.problem == problem and words in check.message, check.message
    if problem:
        assert "Not quite" in check.message and not check.ok


def test_a_number_checker_never_raises_and_hints_when_it_cannot_diagnose():
    from labkit.exercises import check_number
    for answer in ("lots", float("nan"), [1, 2]):
        assert check_number(answer, 10.0, what="x", hint="h", verbose=False).problem \
            == "not a number"
    far = check_number(1234.5, 10.0, what="the bytes", hint="count twice", unit="bytes",
                       verbose=False)
    assert far.problem == "wrong value" and "more than expected" in far.message
    assert "Hint: count twice" in far.message


# ------------------------------------ code checkers: plausible wrong answers, each with its words

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


def test_a_peak_rounded_to_one_pflops_is_accepted_and_said():
    from labkit.exercises import when_it_breaks as wib
    from labkit.theory import hardware
    exact = 6 * catalog.model("llama-3-8b").param_count() * 600_000 / (
        64 * hardware.gpu("H100").bf16_flops)
    rounded = 6 * 8e9 * 600_000 / (64 * 1e15)
    assert abs(rounded / exact - 1) > 0.01                 # outside the 1% tolerance alone
    check = wib.check_mfu_answer(rounded, verbose=False)
    assert check.ok and "rounded to 1 PFLOP/s" in check.message and "989" in check.message
    assert not wib.check_mfu_answer(rounded * 0.9, verbose=False).ok


def test_a_capacity_is_shown_as_the_learner_wrote_it():
    from labkit.exercises import moe
    check = moe.check_capacity_answer(1.25 * 2 * 6000 / 64, verbose=False)
    assert not check.ok and "234.375" in check.message and check.problem == "not rounded"
    assert "round up" in check.message
