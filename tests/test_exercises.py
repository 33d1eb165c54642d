"""Every lesson's exercises, as the two editions give them: each answer cell (tagged `solution`)
is followed by the cell that checks it; the instructor's answer passes its checker, the student
edition's stub fails it with the message a learner should read; and each number checker names
the likely wrong answers (a forgotten factor, bits for bytes, GB for bytes, percent).

Checker cells are run as the notebook runs them (the lesson's import cell, then its answer
cells, then the checking cell's last expression), with the feedback printing silenced.
Every number exercise has a catalog of likely wrong answers here, each named for its mistake;
the code exercises' catalogs are in tests/test_exercise_code.py."""
import ast
import contextlib
import io
import math

import nbformat
import pytest
import torch

from labkit import editions
from labkit.theory import catalog, kernels

LESSONS = ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11"]

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
    "11": ["No answer yet"],
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


def _printed_before_exercises(nb):
    """Everything a learner reads before the exercises: prose and each cell's output text."""
    first = next(i for i, c in enumerate(nb.cells)
                 if c.cell_type == "markdown" and "## Exercises" in c.source)
    text = []
    for cell in nb.cells[:first]:
        text.append(cell.source if cell.cell_type == "markdown" else "")
        for out in cell.get("outputs", []):
            text.append(out.get("text", ""))
            for kind in ("text/plain", "text/markdown", "text/html"):
                text.append(str(out.get("data", {}).get(kind, "")))
    return "\n".join(text)


def _spellings(value):
    """How a lesson would print `value`: with at least 3 significant digits, or exactly as
    Python prints a short decimal (7.5); shorter roundings (22, 4.8) are everywhere."""
    forms = {f"{value:,.0f}", f"{value:.0f}"} if abs(value) >= 100 else set()
    forms |= {f"{value:.3g}", f"{value:.4g}", f"{value:,.1f}", f"{value:,.2f}"}
    if abs(value) < 1:
        forms |= {f"{value:.1%}", f"{value:.3f}"}
    if abs(value) >= 1e9:
        forms |= {f"{value / 1e9:.1f} GB", f"{value / 1e9:.2f} GB"}
    forms = {f for f in forms if sum(ch.isdigit() for ch in f.lstrip("0.")) >= 3
             and not ("." in f and f.rstrip(" GB%").endswith("0"))}    # 1.50 is not 1.5's
    return forms | ({repr(value)} if "." in repr(value) and len(repr(value)) <= 5 else set())


@pytest.mark.parametrize("prefix", LESSONS)
def test_no_answer_is_printed_before_its_exercise(prefix):
    import re
    nb = read(editions.NOTEBOOKS, prefix)
    ns = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(next(c for c in nb.cells if c.cell_type == "code").source, ns)
        answers = []
        for answer, checker in exercises(nb):
            exec(answer.source, ns)
            call = ast.parse(checker.source).body[-1].value
            call = call.value if isinstance(call, ast.NamedExpr) else call
            if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Name):
                value = ns.get(call.args[0].id)     # the checked answer, not a helper
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    answers.append(value)
    shown = _printed_before_exercises(nb)
    for value in answers:
        for form in _spellings(float(value)):
            # 7.5e-08 (a rounding error a lesson prints) is not a spelling of 7.5
            assert not re.search(r"(?<![\d.,])" + re.escape(form) + r"(?![\d]|e[-+]?\d)", shown), \
                f"{form} (an exercise's answer) is printed before the exercises"


# ------------------------------------------------------------ number checkers name the mistake

def _number_exercises():
    """{exercise: (checker, [(a wrong answer worked out as a learner would, its problem)])}.

    Every number is derived here from the catalog's inputs with the mistake made on purpose,
    never from the checker's own formula."""
    from labkit.exercises import context_parallel as cp, data_parallel as dp, hybrid
    from labkit.exercises import moe, pipeline, serving, serving_systems, tensor_parallel as tp
    from labkit.exercises import when_it_breaks as wib, why_parallelism as why, zero
    from labkit.theory import hardware
    psi8, psi70 = catalog.model("llama-3-8b").param_count(), catalog.model("llama-3-70b") \
        .param_count()
    h100, a100 = hardware.gpu("H100"), hardware.gpu("A100")
    gb = 16 * psi8 / 1e9                                          # 00-2's right answer
    s, n = 2 * catalog.model("gpt2-small").param_count(), 16      # 01-2: bf16 grads, 16 GPUs
    ring = 2 * (n - 1) / n * s
    act, t = 1 * 4096 * 8192 * 2, 8                               # 03-2
    block = 4 * 2 * (t - 1) / t * act
    node = hardware.cluster("8xH100-NVLink")
    alpha, eff, line = node.intra.latency, node.intra.effective_bandwidth, node.intra.bandwidth

    in_step = h100.mamf_bf16_flops * kernels.IN_STEP_GEMM_FRACTION  # the measured MAMF x fit

    def tokens(flops=in_step, value_bytes=2, bw=eff, outs=28672 / 8, per=8):
        return per * alpha / (8192 * (2 * outs / flops - value_bytes / bw))
    p8 = 8.03e9                                                   # 04-2, as the lesson gives
    ib = hardware.link("InfiniBand NDR")
    fsdp = h100.bf16_flops / ib.effective_bandwidth * 3 * 63 / 64 * 2 / 6
    local = psi70 / (8 * 4)                                       # 06-3
    mfu = 6 * psi8 * 600_000 / (64 * h100.bf16_flops)
    kv = 2 * 8 * (65536 // 16) * 128 * 2                          # 08-3: one block
    cache = 80 * 2 * 8 * 128 * 8192 * 8 * 2                       # 09-2
    tpot = 2 * psi8 / h100.memory_bw * 1e3
    return {
        "00-2": (why.check_gb_no_zero, [
            (2 * psi8 / 1e9, "weights only"), (16 * psi8 / 8 / 1e9, "divided by GPUs"),
            (4 * psi8 / 1e9, "no optimizer"), (12 * psi8 / 1e9, "optimizer only"),
            ((2 + 2 + 4 + 4) * psi8 / 1e9, "no master copy"),
            (18 * psi8 / 1e9, "fp32 gradients"), (16 * psi8, "bytes, not GB"),
            (16 * psi8 / 2 ** 30, "GiB"), (8 * gb, "bits")]),
        "00-3": (why.check_fewest_gpus_zero3, [
            (1, "does not fit"), (math.ceil(2 * psi8 / h100.memory_bytes), "weights only"),
            (16 * psi8 / h100.memory_bytes, "not whole"), (3, "one too many")]),
        "01-2": (dp.check_ring_bytes, [
            (2 * s, "factor (N-1)/N"), ((n - 1) / n * s, "one phase"),
            (ring / 2, "values, not bytes"), (2 * (n - 1) * s, "whole tensor"),
            (2 * (n - 1) / n * 2 * s, "fp32"), (s, "just S"), (8 * ring, "bits"),
            (ring / 1e9, "GB, not bytes")]),
        "02-2": (pipeline.check_gpipe_bubble, [
            (5 / 20, "over ideal"), (5 / 6, "one batch"), (5 / 26, "M+P slots"),
            (6 / 26, "waits P slots"), (20 / 25, "busy share"), (100 * 5 / 25, "percent")]),
        "02-3": (pipeline.check_dualpipe_idle, [
            (7 * (1 + 1.5 + 1.5 - 1.5), "P-1"), (7 * (1 + 1.5), "1F1B's"),
            (3 * (2 + 1 - 1.5), "input grad only"), (3 * (1 + 1.5 - 1.5), "F&B = F"),
            (7 * (1 + 1.5 - 1), "ZB-H1's"), (3 * (2.5 + 1.5 - 1.5) / 1e3, "seconds")]),
        "03-2": (tp.check_block_bytes, [
            (2 * 2 * 7 / 8 * act, "half the calls"), (4 * 7 / 8 * act, "one phase"),
            (block / 2, "values, not bytes"), (2 * 7 / 8 * act, "one call"),
            (4 * act, "payload"), (4 * 2 * act, "factor (t-1)/t"), (2 * block, "fp32"),
            (block / t, "divided by t"), (8 * block, "bits"), (block / 1e9, "GB, not bytes")]),
        "03-3": (tp.check_break_even_tokens, [
            (tokens(flops=h100.bf16_flops), "peak"),
            (tokens(flops=2 * in_step), "FLOPs per multiply-add"),
            (tokens(flops=h100.bf16_flops * node.mfu), "constant MFU"),
            (tokens(value_bytes=4), "fp32"), (tokens(bw=line), "line rate"),
            (tokens(outs=28672), "all outputs"), (tokens(per=1), "chunk = T"),
            (0, "no latency")]),
        "04-2": (lambda a, verbose=False: zero.check_stage_memory_answer(
            a, params=p8, world_size=8, stage=2, verbose=verbose), [
            (16 * p8, "baseline"), ((4 + 12 / 8) * p8, "stage 1"), (16 * p8 / 8, "stage 3"),
            ((2 + (2 + 8) / 8) * p8, "no master copy"), ((4 + 14 / 8) * p8, "fp32 weights"),
            ((2 + 14 / 8) * p8 * 8, "bits"), ((2 + 14 / 8) * p8 / 1e9, "GB, not bytes")]),
        "04-3": (zero.check_fsdp_critical_batch, [
            (fsdp * 2 / 3, "DP's bytes"), (fsdp * 2 / 3, "one all-gather"),
            (h100.bf16_flops / ib.bandwidth * 3 * 63 / 64 * 2 / 6, "line rate"),
            (h100.bf16_flops / (ib.effective_bandwidth * 8) * 3 * 63 / 64 * 2 / 6, "bits"),
            (fsdp / 2, "bytes per value"), (fsdp * 6 / 2, "forward only"),
            (fsdp / node.mfu, "at mfu")]),
        "05-2": (moe.check_capacity_answer, [
            (1.25 * 2 * 6000 / 64, "not rounded"), (234, "rounded down"),
            (round(1.25 * 2 * 6000 / 64), "rounded to nearest"),
            (math.ceil(1.25 * 6000 / 64), "forgot k"), (math.ceil(2 * 6000 / 64),
                                                        "forgot the factor"),
            (math.ceil(6000 / 64), "even share"), (math.ceil(1.25 * 6000 / 128),
                                                   "divided by k")]),
        "06-3": (hybrid.check_hybrid_memory, [
            (16 * local / 1e9, "no ZeRO"), (16 * psi70 / 8 / 1e9, "forgot pp"),
            (16 * psi70 / 4 / 1e9, "forgot tp"), (16 * local / 2 / 1e9, "ZeRO-3"),
            ((2 + 14 / 2) * local / 1e9, "ZeRO-2"), ((2 + 4 + 6) * local / 1e9,
                                                     "fp32 gradients"),
            (10 * local, "bytes, not GB")]),
        "07-2": (wib.check_mfu_answer, [
            (mfu / 2, "sparse peak"), (2 * psi8 * 600_000 / (64 * h100.bf16_flops),
                                       "forward only"),
            (8 * psi8 * 600_000 / (64 * h100.bf16_flops), "recompute"),
            (6 * psi8 * 600_000 / h100.bf16_flops, "one GPU"),
            (6 * psi8 * 600_000 / (64 * a100.bf16_flops), "wrong GPU"), (100 * mfu, "percent"),
            (6 * psi8 * 600_000 / 64 / (64 * h100.bf16_flops), "GPUs twice")]),
        "08-3": (cp.check_ring_bytes, [
            (16 * kv, "one pass too many"), (15 * kv / 2, "K only"),
            (15 * kv / 2, "values, not bytes"), (15 * kv * 64 / 8, "query heads"),
            (15 * kv * 8, "bits"), (15 * kv * 16, "whole sequence"), (kv, "one block"),
            (2 * 15 * kv, "fp32"), (2 * 15 * kv, "forward and backward")]),
        "09-2": (serving.check_kv_bytes, [
            (cache / 2, "forgot k or v"), (cache / 2, "values, not bytes"),
            (cache * 64 / 8, "no GQA"), (cache * 8, "bits"), (cache / 80, "one layer"),
            (cache * 2, "fp32"), (cache / 8, "one request"), (cache / 1e9, "GB, not bytes")]),
        "10-3": (serving_systems.check_requests_that_fit, [
            (16384 // 300, "no rounding up"), (16384 // 4096, "contiguous"),
            (16384 // 16 // (300 // 16), "blocks rounded down"),
            (math.ceil(16384 / 16 / math.ceil(300 / 16)), "count rounded up"),
            (16384 / 16 / math.ceil(300 / 16), "not whole")]),
        "09-3": (serving.check_tpot_floor, [
            (2 * psi8 / h100.bf16_flops * 1e3, "compute, not memory"), (tpot / 2,
                                                                      "1 byte per weight"),
            (tpot * 8, "bits"), (tpot / 1e3, "seconds"), (tpot * 2, "fp32 weights"),
            (1e3 / tpot, "tokens per second")]),
    }


NUMBER_EXERCISES = sorted(_number_exercises())


def _cases():
    return [(ex, answer, problem) for ex in NUMBER_EXERCISES
            for answer, problem in _number_exercises()[ex][1]]


@pytest.mark.parametrize("exercise, answer, problem", _cases(),
                         ids=[f"{e}-{p}" for e, _, p in _cases()])
def test_each_likely_wrong_answer_is_named_for_its_mistake(exercise, answer, problem):
    check = _number_exercises()[exercise][0](answer, verbose=False)
    assert not check.ok and "Not quite" in check.message, check.message
    assert problem in (check.problems or (check.problem,)), (problem, check.problems,
                                                              check.message)
    assert "\n" not in check.message


@pytest.mark.parametrize("exercise", NUMBER_EXERCISES)
def test_different_mistakes_never_share_a_diagnosis_and_equal_ones_name_each_other(exercise):
    checker, catalog_ = _number_exercises()[exercise]
    said = [(answer, problem, checker(answer, verbose=False)) for answer, problem in catalog_]
    tolerance = 0 if exercise in ("00-3", "05-2", "10-3") else 0.01     # counts are exact
    for i, (a, pa, ca) in enumerate(said):
        for b, pb, cb in said[i + 1:]:
            if abs(a - b) <= tolerance * max(abs(a), abs(b)):    # one number, two mistakes
                assert pb in ca.problems and pa in cb.problems, (pa, pb, ca.message)
                assert "different mistakes give this number" in ca.message
            else:
                assert not set(ca.problems) & set(cb.problems), (pa, pb, ca.problems)
                assert ca.message.split(": ", 2)[-1] != cb.message.split(": ", 2)[-1]


def _exercise_module(exercise):
    checker = _number_exercises()[exercise][0]
    name = {"00": "why_parallelism", "01": "data_parallel", "02": "pipeline",
            "03": "tensor_parallel", "04": "zero", "05": "moe", "06": "hybrid",
            "07": "when_it_breaks", "08": "context_parallel", "09": "serving",
            "10": "serving_systems"}[exercise[:2]]
    import importlib
    return checker, importlib.import_module(f"labkit.exercises.{name}")


@pytest.mark.parametrize("exercise", NUMBER_EXERCISES)
def test_a_first_miss_gets_the_concept_the_second_the_formula(exercise, capsys):
    checker, module = _exercise_module(exercise)
    number = int(exercise[-1])
    module.show_solution(number)
    formula = capsys.readouterr().out.strip()
    assert formula
    first, second = (checker(3.217e-7, verbose=False) for _ in range(2))   # matches no mistake
    assert first.problem == second.problem == "wrong value", first.message
    assert "Hint:" in first.message and formula not in first.message, first.message
    call = "show_solution()" if number == 1 else f"show_solution({number})"
    assert call in first.message
    assert f"The formula: {formula}" in second.message, second.message


def test_no_answer_gives_the_concept_and_is_not_counted_as_a_miss():
    from labkit.exercises import serving
    none = serving.check_kv_bytes(None, verbose=False)
    assert none.problem == "no answer" and "Hint:" in none.message
    assert "Hint:" in serving.check_kv_bytes(1.0, verbose=False).message   # still the first


@pytest.mark.parametrize("exercise", NUMBER_EXERCISES)
def test_a_number_checker_answers_any_input_in_one_line(exercise):
    import numpy as np
    checker = _number_exercises()[exercise][0]
    for answer in (None, "lots", [1, 2], torch.tensor([1.0, 2.0]), np.ones(3), float("nan"),
                   float("inf"), True, {"a": 1}, torch.tensor(3.0, requires_grad=True)):
        check = checker(answer, verbose=False)
        assert not check.ok and check.message and "\n" not in check.message, (answer, check)


def _kv_waste_answers():
    """Exercise 10-2's two numbers as a learner works them out (Llama 3 8B: 32 layers, 8 KV
    heads of 128 of its 32 heads, bf16), right and with each slip made on purpose."""
    lengths, per_value = (37, 120, 301, 64), 2 * 32 * 8 * 128        # k and v, every layer
    unused = {"contiguous": sum(512 - n for n in lengths),
              "paged": sum(-(-n // 16) * 16 - n for n in lengths)}
    reserved = {"contiguous": 4 * 512, "paged": sum(-(-n // 16) * 16 for n in lengths)}
    right = {k: 2 * per_value * u for k, u in unused.items()}
    return right, {
        "values, not bytes": {k: per_value * u for k, u in unused.items()},
        "no GQA": {k: 2 * 2 * 32 * 32 * 128 * u for k, u in unused.items()},
        "GiB, not bytes": {k: v / 2 ** 30 for k, v in right.items()},
        "reserved, not wasted": {k: 2 * per_value * r for k, r in reserved.items()}}


@pytest.mark.parametrize("slip", list(_kv_waste_answers()[1]))
@pytest.mark.parametrize("number", ["contiguous", "paged"])
def test_each_kv_waste_slip_is_named_on_its_own_number(slip, number):
    from labkit.exercises import reset_hints, serving_systems
    reset_hints()
    right, slips = _kv_waste_answers()
    answers = dict(right, **{number: slips[slip][number]})
    check = serving_systems.check_wasted_bytes(answers["contiguous"], answers["paged"],
                                               verbose=False)
    assert not check.ok and f"{number}: {slip}" in check.problems, check.message
    assert all(p.startswith(number) for p in check.problems), check.problems
    assert "\n" not in check.message


def test_kv_waste_numbers_keep_their_own_hint_counters():
    from labkit.exercises import reset_hints, serving_systems
    reset_hints()
    right, slips = _kv_waste_answers()
    both_wrong = (3 * right["contiguous"], 3 * right["paged"])
    first = serving_systems.check_wasted_bytes(*both_wrong, verbose=False)
    assert first.message.count("Hint:") == 2 and "The formula" not in first.message, \
        first.message
    assert "512 - length" in first.message and "last block" in first.message
    second = serving_systems.check_wasted_bytes(*both_wrong, verbose=False)
    assert second.message.count("The formula") == 2 and "Hint:" not in second.message
    bytes_forgotten = serving_systems.check_wasted_bytes(
        slips["values, not bytes"]["contiguous"], right["paged"], verbose=False)
    assert "each bf16 value is 2 bytes" in bytes_forgotten.message     # named, not only k/v


def test_a_count_of_requests_near_the_true_division_is_told_to_round_down():
    from labkit.exercises import serving_systems
    check = serving_systems.check_requests_that_fit(53.9, verbose=False)
    assert check.problem == "not whole" and "53.9 " in check.message, check.message
    up = serving_systems.check_requests_that_fit(math.ceil(1024 / 19), verbose=False)
    assert "round the count down" in up.message and "count rounded up" in up.problems


def test_a_one_element_tensor_is_read_as_its_number():
    from labkit.exercises import moe
    assert moe.check_capacity_answer(torch.tensor(235), verbose=False).ok
    assert moe.check_capacity_answer(torch.tensor([235.0]), verbose=False).ok


def test_a_number_checker_hints_when_it_cannot_diagnose():
    from labkit.exercises import Hints, check_number
    hints = Hints("think twice", "x = 10")
    for answer in ("lots", float("nan"), [1, 2]):
        assert check_number(answer, 10.0, what="x", hints=hints, verbose=False).problem \
            == "not a number"
    far = check_number(1234.5, 10.0, what="the bytes", hints=hints, unit="bytes",
                       verbose=False)
    assert far.problem == "wrong value" and "more than expected" in far.message
    assert "Hint: think twice" in far.message and "x = 10" not in far.message
    assert "The formula: x = 10" not in far.message
    assert "The code: x = 10" in check_number(1234.5, 10.0, what="b", hints=hints,
                                              verbose=False).message


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
