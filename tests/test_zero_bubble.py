"""Zero-bubble pipelines (Qi et al. 2023): ZB-H1 as schedule data, its bubble against the paper's
formula and a hand count, its activation memory against 1F1B, the checks on W ops; the
executor (parallel/zero_bubble.py) on 2 and 4 ranks against one device (the MLP with a frozen
bias and labkit's tiny GPT; fp32 and bf16, judged by labkit.numerics: within a few times one
device's own rounding in the same dtype, against a float64 run), in the schedule's order."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import models, numerics
from labkit.parallel.pipeline import PipelineStage, split_into_stages
from labkit.parallel.zero_bubble import ZeroBubbleSchedule
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


# ------------------------------------------------------------------ the executor on ranks

MICRO, ROWS = 8, 16


def _mlp():
    torch.manual_seed(0)
    mlp = nn.Sequential(*[nn.Sequential(nn.Linear(a, 16), nn.GELU()) for a in (8, 16, 16)],
                        nn.Linear(16, 4))
    mlp[1][0].bias.requires_grad_(False)        # a frozen weight: W must leave it alone
    return mlp


def _gpt():
    torch.manual_seed(0)
    return models.TinyGPT(models.GPTConfig(**GPT))


GPT = dict(layers=4, hidden=16, heads=2, seq=8, vocab=16, ffn=32)


def _data(kind):
    g = torch.Generator().manual_seed(7)
    if kind == "gpt":
        return (torch.randint(GPT["vocab"], (ROWS, GPT["seq"]), generator=g),
                torch.randint(GPT["vocab"], (ROWS, GPT["seq"]), generator=g))
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)


def _loss(kind):
    if kind == "gpt":
        return lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss


def _build(kind, dtype):
    return (_gpt() if kind == "gpt" else _mlp()).to(dtype)


def _grad_agreement(ctx, kind, dtype=torch.float32):
    """ZB-H1 on the world's ranks: each rank's weight gradients and the loss against one
    device's in the same dtype and a float64 run (labkit.numerics)."""
    model = _build(kind, dtype)
    x, y = numerics.cast(_data(kind), dtype)
    n, first = ctx.world_size, len(ctx.clock.events)
    modules = split_into_stages(model, n, balance="params" if kind == "gpt" else "layers")
    shape = ((ROWS // MICRO, GPT["seq"], GPT["hidden"]) if kind == "gpt"
             else (ROWS // MICRO, 16))
    stage = PipelineStage(modules[ctx.rank], ctx.rank, n,
                          input_shape=None if ctx.rank == 0 else shape, input_dtype=dtype)
    pipe = ZeroBubbleSchedule(stage, _loss(kind), MICRO)
    loss = pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)
    # One device takes the same micro-batches and accumulates their gradients in `dtype`
    # (in bf16 each of the M additions rounds: a full-batch bf16 run would not share that
    # rounding, and the pipeline's error would be M-fold its "own")
    single, exact = _build(kind, dtype), _build(kind, torch.float64)
    parts = [_loss(kind)(single(xs), ys) / MICRO for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO))]
    for part in parts:
        part.backward()
    single_loss = sum(part.detach() for part in parts)
    exact_loss = _loss(kind)(exact(numerics.cast(x, torch.float64)),
                             numerics.cast(y, torch.float64))
    exact_loss.backward()
    mine = {id(q) for q in stage.parameters()}
    names = [name for name, q in model.named_parameters() if id(q) in mine and q.requires_grad]

    def grads(module):
        by_name = dict(module.named_parameters())
        return {name: by_name[name].grad for name in names}
    grad_agreement = numerics.compare(grads(model), grads(single), grads(exact))
    frozen = [q.grad is None for name, q in model.named_parameters()
              if id(q) in mine and not q.requires_grad]
    timeline = [e for e in ctx.clock.timeline()[first:] if e["kind"] == "compute"
                and e["name"] in ("forward", "backward", "weight grad")]
    ops = [(e["name"], e["meta"]["microbatch"]) for e in timeline]
    loss_agreement = None if loss is None else numerics.compare_loss(
        [loss.item()], [single_loss.item()], [exact_loss.item()])
    return dict(grads=grad_agreement, frozen=frozen, ops=ops, loss=loss_agreement,
                timeline=timeline)


def zero_bubble_checks(ctx):
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("mlp", "gpt"):
            ctx.comm.barrier()                  # each model starts together on the clock
            out[kind if dtype == torch.float32 else f"{kind} bf16"] = _grad_agreement(
                ctx, kind, dtype)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def executed(request):
    return request.param, labkit.launch(zero_bubble_checks, request.param, timeout_s=300,
                                        cluster=pp.comm_free_cluster())


@pytest.mark.numerics
def test_zb_h1_on_ranks_equals_one_device(executed):
    n, results = executed
    for kind in ("mlp", "gpt", "mlp bf16", "gpt bf16"):
        for rank, r in enumerate(results):
            assert r[kind]["grads"].ok, (n, kind, rank, str(r[kind]["grads"]))
            assert all(r[kind]["frozen"])
        assert results[-1][kind]["loss"].ok, (n, kind, str(results[-1][kind]["loss"]))


def test_the_executor_runs_the_schedules_order(executed):
    n, results = executed
    names = {"F": "forward", "B": "backward", "W": "weight grad"}
    for rank, r in enumerate(results):
        expected = [(names[k], m) for k, m, _ in pp.zb_h1_schedule(n, MICRO)[rank]
                    if not (k == "B" and rank == 0)]   # the first stage has no input grad
        assert r["mlp"]["ops"] == expected


def test_the_simulator_replays_the_runs_modelled_timeline(executed):
    """On free links, the executor's modelled op start times are the simulator's, given the
    run's own op times: the executor keeps the schedule's timing rules."""
    n, results = executed
    for kind in ("mlp", "gpt"):
        timeline = [e for r in results for e in r[kind]["timeline"]]
        t0 = min(e["start"] for e in timeline)
        real = sorted((e["rank"], e["name"], e["meta"]["microbatch"], e["start"] - t0)
                      for e in timeline)
        simulated = sorted((e["rank"], e["name"], e["meta"]["microbatch"], e["start"])
                           for e in pp.simulate_like(timeline, pp.zb_h1_schedule(n, MICRO))
                           if e["kind"] == "compute" and e["end"] > e["start"])
        assert [r[:3] for r in real] == [s[:3] for s in simulated]
        for got, want in zip(real, simulated):
            assert got[3] == pytest.approx(want[3], rel=1e-6, abs=1e-15), (kind, got, want)


def test_executor_refuses_what_it_cannot_run():
    def refuse(ctx):
        stage = PipelineStage(nn.Linear(2, 2), ctx.rank, 2)
        out = []
        for call in (lambda: ZeroBubbleSchedule(stage, F.mse_loss, 4),
                     lambda: ZeroBubbleSchedule(stage, F.mse_loss, 4, schedule="1f1b")):
            try:
                call()
                out.append(None)
            except ValueError as error:
                out.append(str(error))
        return out
    first, second = labkit.launch(refuse, 2, timeout_s=300)
    assert first[0] is None and "needs input_shape=" in second[0]
    assert "must be 'zb-h1'" in first[1]
