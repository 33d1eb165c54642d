"""Lesson 02's exercise: write the 1F1B order of ops for one stage of a 4-stage pipeline.

`check_stage_order(my_ops)` puts the learner's order on one stage, labkit's 1F1B on the others,
checks the schedule the way the executor does (every op once, F before B, no deadlock: replayed
by the simulator), then runs it for real with `PipelineSchedule` on a small nn.Sequential and
compares the parameters with one device. A valid order that is not 1F1B is said to be valid,
with what 1F1B would change (its warm-up and its bubble, simulated with the run's own op times).
It answers with a `Check`; it never raises.
`check_gpipe_bubble(answer)` checks a number: GPipe's bubble fraction for P stages and M
micro-batches, against `theory.time.bubble_fraction`. `check_dualpipe_idle(answer)` checks
DualPipe's idle milliseconds per rank against its order replayed by the simulator
(`theory.pipeline_layouts`), not against the formula the learner is asked to use.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.pipeline import PipelineSchedule, PipelineStage, split_into_stages
from ..theory import pipeline as schedules
from ..theory import pipeline_layouts as layouts
from ..theory.time import bubble_fraction, bubble_over_ideal
from . import (Check, Hints, Mistake, check_number, not_started, say, show, with_hint)

WIDTH, BATCH, LR = 16, 8, 0.1


def exercise_model(stages):
    """The same small MLP on every rank: `stages` layers of Linear (+ GELU but the last)."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(stages - 1)]
    return nn.Sequential(*layers, nn.Linear(WIDTH, WIDTH))


def exercise_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def parse_ops(ops):
    """'F0' / ('F', 0) / ('F', 0, 0) -> ('F', 0, 0)."""
    out = []
    for op in ops:
        if isinstance(op, str):
            op = (op[0].upper(), int(op[1:]))
        kind, m, *chunk = op
        kind = str(kind).upper()
        if kind not in ("F", "B"):
            raise ValueError(f"{kind!r} is neither F nor B")
        out.append((kind, int(m), int(chunk[0]) if chunk else 0))
    return out


def _train_one_step(ctx, schedule, microbatches):
    """One SGD step of the exercise model through the pipeline; this rank's parameters."""
    model = exercise_model(ctx.world_size)
    stage = PipelineStage(split_into_stages(model, ctx.world_size)[ctx.rank], ctx.rank,
                          ctx.world_size)
    pipe = PipelineSchedule(stage, microbatches, F.mse_loss, schedule=schedule)
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    x, y = exercise_batch()
    pipe.step(x, target=y)
    optimizer.step()
    return dict(params={k: q.detach().clone() for k, q in stage.module.named_parameters()},
                timeline=ctx.clock.timeline())


def _reference(stages):
    model = exercise_model(stages)
    x, y = exercise_batch()
    F.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {k: q.detach() for k, q in model.named_parameters()}


def check_stage_order(my_ops, stage=0, stages=4, microbatches=8, timeout_s=60, verbose=True):
    """The learner's order of ops for `stage`, the other stages running 1F1B: malformed,
    deadlock, wrong result, right but holding more than 1F1B, or right (and 1F1B?). Prints
    the feedback (`say`) and returns the Check."""
    check = _stage_order(my_ops, stage, stages, microbatches, timeout_s)
    check = with_hint(check, ORDER_HINTS)
    return say(check, verbose)


ORDER_HINTS = Hints(
    concept="a stage may start a backward as soon as its micro-batch's gradient can arrive, "
            "and 1F1B does: it runs only as many forwards as the stages after it need to fill "
            "the pipe, then alternates, so it never holds more than P - stage micro-batches.",
    code="stage s of P with M micro-batches: ['F0', ..., 'F{P-1-s-1}'] (P-1-s warm-up "
         "forwards), then for i in range(M - (P-1-s)): 'F{P-1-s+i}', 'B{i}'; then the "
         "remaining Bs in order. For P = 4, M = 8, stage 0: F0 F1 F2, F3 B0 F4 B1 ... F7 B4, "
         "B5 B6 B7.")
BUBBLE_HINTS = Hints(
    concept="count slots of one micro-batch's forward: how many slots does the whole step "
            "last, and in how many of them is a given stage busy?",
    code="bubble = (P-1) / (M+P-1): P-1 idle slots (fill and drain) out of M+P-1.",
    exercise=2, kind="formula")
DUALPIPE_HINTS = Hints(
    concept="Table 2 of the DeepSeek-V3 report gives DualPipe's idle per rank; read which "
            "backward its B is, and what an overlapped F&B slot costs when there is no "
            "communication to hide.",
    code="Table 2: (P/2-1)(F&B + B - 3W), B the full backward (T_B + T_W), F&B = F + B "
         "with free links.", exercise=3, kind="formula")
HINTS = {1: ORDER_HINTS, 2: BUBBLE_HINTS, 3: DUALPIPE_HINTS}


def show_solution(exercise=1):
    """Print the code (exercise 1) or the formula (2, 3)."""
    show(HINTS, exercise)


def _stage_order(my_ops, stage, stages, microbatches, timeout_s):
    from ..runtime.launch import LaunchError, launch
    p, m = stages, microbatches
    if my_ops is None:
        return Check(False, "no answer", f"No answer yet: write stage {stage}'s ops in order, "
                     "like ['F0', 'F1', 'B0', ...]. Hint: 1F1B runs P - 1 - stage warm-up "
                     "forwards, then alternates one F and one B, then drains the Bs.")
    try:
        ops = parse_ops(my_ops)
    except (ValueError, TypeError, IndexError) as error:
        return Check(False, "unreadable", f"Could not read the ops ({error}): write them like "
                     "['F0', 'F1', 'B0', ...].")
    schedule = schedules.one_f_one_b_schedule(p, m)
    schedule[stage] = ops
    try:
        schedules.check_schedule(schedule, m, 1)
    except ValueError as error:
        if "deadlock" in str(error):
            stuck = str(error).removeprefix("deadlock: ")
            return Check(False, "deadlock", f"DEADLOCK: {stuck}. Each of these ranks waits for "
                         "a message that its neighbour sends only after it gets one back. The "
                         "executor refuses such a schedule before any rank waits.")
        return Check(False, "malformed", f"WRONG SCHEDULE: {error}.")
    try:
        results = launch(_train_one_step, p, schedule, m, timeout_s=timeout_s,
                         cluster=schedules.comm_free_cluster())
    except LaunchError as error:
        if (busy := not_started(str(error))) is not None:
            return Check(False, "slow", busy)
        last = [line for line in str(error).splitlines() if line.strip()][-1].strip()
        return Check(False, "run failed", f"The run failed on a rank: {last}")
    params = {k: v for r in results for k, v in r["params"].items()}
    expected = _reference(p)
    diff = max((params[k] - expected[k]).abs().max().item() for k in expected)
    if diff > 1e-5:
        return Check(False, "wrong result", f"WRONG RESULT: the parameters differ from one "
                     f"device by {diff:.2e}.")
    timeline = [e for r in results for e in r["timeline"]]
    held, bound = schedules.microbatches_in_flight(ops), min(m, p - stage)
    text = (f"same parameters as one device (max diff {diff:.1e}); bubble "
            f"{schedules.timeline_bubble_fraction(timeline):.3f} (modelled on free links; the "
            f"formula's {schedules.bubble_formula(p, m):.3f} assumes equal stages, and this "
            f"MLP's first stage has a shorter backward: its input needs no gradient); stage "
            f"{stage} holds at most {held} micro-batches' activations")
    if held > bound:
        return Check(False, "memory", f"RIGHT RESULT, TOO MUCH MEMORY: {text}, more than "
                     f"1F1B's {bound} (P - stage). Start the backwards earlier: after "
                     f"{p - stage - 1} warm-up forwards, alternate F and B.")
    one_f_one_b = schedules.one_f_one_b_schedule(p, m)
    if ops != one_f_one_b[stage]:
        return _valid_not_1f1b(text, ops, stage, p, timeline, one_f_one_b)
    return Check(True, "", f"CORRECT: {text}. That is exactly 1F1B.")


def _valid_not_1f1b(text, ops, stage, p, timeline, one_f_one_b):
    """A valid, right, memory-bounded order that is not 1F1B: what 1F1B would change."""
    yours = schedules.timeline_bubble_fraction(timeline)
    ideal = schedules.timeline_bubble_fraction(schedules.simulate_like(timeline, one_f_one_b))
    warm = next((i for i, op in enumerate(ops) if op[0] == "B"), len(ops))
    change = (f"the bubble drops from your {yours:.3f} to {ideal:.3f} (simulated with this "
              "run's op times)" if ideal < yours - 5e-4 else
              f"the bubble stays {ideal:.3f} here, and the order is the standard one")
    return Check(False, "not 1F1B", (
        f"VALID, BUT NOT 1F1B: {text}. Your stage {stage} runs {warm} forwards before its "
        f"first backward; 1F1B runs P - stage = {p - stage} ({p - 1 - stage} warm-up forwards, "
        "then one F before each B, so the later stages never wait for a forward), then "
        f"alternates one F and one B, then drains the Bs: {change}."))


BUBBLE_STAGES, BUBBLE_MICROBATCHES = 6, 20


def check_gpipe_bubble(answer, stages=BUBBLE_STAGES, microbatches=BUBBLE_MICROBATCHES,
                       verbose=True):
    """The share of a GPipe step each stage sits idle, as a fraction of the step's time."""
    p, m = stages, microbatches
    expected = bubble_fraction(p, m)
    mistakes = [
        Mistake(bubble_over_ideal(p, m), "over ideal", "that is the bubble divided by the busy "
                "time (P-1)/M; the question asks for a share of the whole step, busy time + "
                "bubble"),
        Mistake((p - 1) / p, "one batch", "that is the idle share without micro-batches (M = "
                "1); with M micro-batches the same fill and drain are shared by M"),
        Mistake((p - 1) / (m + p), "M+P slots", "count the slots again: the step is one slot "
                "shorter than M+P (the last stage's first forward starts P-1 slots in)"),
        Mistake(p / (m + p), "waits P slots", "the first stage starts at once: a stage "
                "waits P-1 slots, not P"),
        Mistake(1 - expected, "busy share", "that is the busy share; the question asks for the "
                "idle one"),
    ]
    return check_number(answer, expected, what=f"GPipe's bubble for P = {p} stages and M = {m} "
                        "micro-batches", unit="fraction", mistakes=mistakes, verbose=verbose,
                        hints=BUBBLE_HINTS,
                        explain="1F1B has the same bubble, with less memory.")


DUALPIPE_STAGES, DUALPIPE_TIMES = 8, (1.0, 1.0, 0.5)     # ms: T_F, T_B (input grad), T_W


def check_dualpipe_idle(answer, stages=DUALPIPE_STAGES, times=DUALPIPE_TIMES, verbose=True):
    """How long each rank idles per step under DualPipe (ms), free links, F&B = F + B."""
    p, (t_f, t_b, t_w) = stages, times
    schedule = layouts.dualpipe_schedule(p, 2 * p)
    expected = max(layouts.idle_per_rank(layouts.simulate_laid_out(schedule, *times)))
    full = t_b + t_w
    mistakes = [
        Mistake((p - 1) * (t_f + t_b + t_w + full - 3 * t_w), "P-1",
                "DualPipe's factor is P/2-1: each direction fills only half the pipe"),
        Mistake((p / 2 - 1) * (t_f + t_b + t_b - 3 * t_w), "input grad only",
                "Table 2's B is the full backward, input and weight gradients: B = T_B + T_W, "
                "and F&B = F + B"),
        Mistake((p / 2 - 1) * (t_f + full - 3 * t_w), "F&B = F",
                "with free links the overlap hides nothing: F&B takes F + B"),
        Mistake((p - 1) * (t_f + full - 2 * t_w), "ZB-H1's",
                "that is ZB-H1's (ZB1P's) idle, (P-1)(F+B-2W); DualPipe's is in Table 2's "
                "last row"),
        Mistake((p - 1) * (t_f + full), "1F1B's", "that is 1F1B's idle, (P-1)(F+B): DualPipe "
                "feeds both ends and fills the bubble with weight gradients"),
        Mistake((p / 2 - 1) * (t_f + full + full - 3 * t_w) / 1e3, "seconds",
                "that is seconds; give milliseconds"),
    ]
    return check_number(answer, expected, what=f"DualPipe's idle per rank, P = {p}, "
                        f"T_F = {t_f:g} ms, T_B = {t_b:g} ms, T_W = {t_w:g} ms", unit="ms",
                        mistakes=mistakes, verbose=verbose, hints=DUALPIPE_HINTS,
                        explain="The replayed order idles just that (T_F = T_B); ZB-H1 idles "
                                f"{(p - 1) * (t_f + t_b - t_w):g} ms, with half the weights.")
