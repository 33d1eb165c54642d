"""Mixture of Experts: routing, capacity and drops on one device; ExpertParallel on labkit's
MoELayer and on a hand-written MoE layer equals one device (outputs and parameters after 3
steps, top-1/top-2, with and without drops, SGD and AdamW, 2 and 4 ranks, a plain spawn
program, a sub-group); one-line errors; the run report, the CLI and inference."""
import functools
import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import cli, numerics
from labkit.exercises.moe import check_top_k_routing, reference_top_k_routing
from labkit.models import MoEConfig, MoELayer, choice_counts, queue_offsets, queue_positions
from labkit.runs import moe
from labkit.runs.reference import RunConfig
from labkit.runtime.launch import launch
from labkit.theory import moe as tmoe
from spawn_helpers import spawn

TINY = dict(layers=2, hidden=32, ffn=64, seq=16, heads=2)
HIDDEN, EXPERTS, TOKENS, STEPS = 16, 4, 64, 3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls in this process (the references): one thread is faster on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ single-process routing

def test_queue_order_is_first_choices_then_token_index():
    expert = torch.tensor([[0, 1], [1, 0], [0, 1]])     # 3 tokens, top-2 of 2 experts
    counts = choice_counts(expert, 2)[None]
    assert queue_offsets(counts, 0).tolist() == [[0, 0], [2, 1]]  # 2nd choices queue behind
    pos = queue_positions(expert, 2, queue_offsets(counts, 0))   # all 1st choices
    # expert 0: token 0 (1st), token 2 (1st), token 1 (2nd); expert 1: token 1, token 0, token 2
    assert pos.tolist() == [[0, 1], [0, 2], [1, 2]]


def test_capacity_drops_and_residual():
    torch.manual_seed(0)
    layer = MoELayer(16, 32, MoEConfig(experts=4, top_k=1, capacity_factor=0.5))
    out = layer(torch.randn(64, 16))
    r = layer.last[0]
    assert r.capacity == 8 == tmoe.capacity(64, 4, 1, 0.5)
    assert torch.bincount(r.expert[r.kept], minlength=4).max() <= r.capacity
    assert r.dropped == int((r.group_load - r.capacity).clamp(min=0).sum()) > 0
    dropped_tokens = (~r.kept).all(dim=1)
    assert torch.equal(out[dropped_tokens], torch.zeros_like(out[dropped_tokens]))
    assert (out[~dropped_tokens].abs().sum(dim=1) > 0).all()


@pytest.mark.parametrize("k", [1, 2])
def test_capacity_dispatch_equals_dense_dispatch_when_nothing_is_dropped(k):
    torch.manual_seed(1)
    layer = MoELayer(16, 32, MoEConfig(experts=4, top_k=k, capacity_factor=4.0))
    x = torch.randn(48, 16)
    sparse = layer(x)
    assert layer.last[0].dropped == 0
    assert torch.allclose(sparse, layer.dense_forward(x), atol=1e-6)


# ----------------------------------------------- ExpertParallel equals one device: the runs

class HandMoE(nn.Module):
    """Not labkit's: an nn.Linear router, a ModuleList of ReLU experts, its own loops;
    `frozen`: every expert's output bias is frozen."""

    def __init__(self, hidden, experts, top_k, capacity_factor, frozen=False):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, hidden))
            for _ in range(experts))
        for expert in self.experts if frozen else ():
            expert[2].bias.requires_grad_(False)
        self.top_k, self.capacity_factor = top_k, capacity_factor

    def forward(self, x):
        p, e = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        w = p / p.sum(-1, keepdim=True) if self.top_k > 1 else p
        slots = math.ceil(self.capacity_factor * self.top_k * x.shape[0] / len(self.experts))
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            queue = [(t, j) for j in range(self.top_k)              # first choices first
                     for t in (e[:, j] == i).nonzero().flatten().tolist()][:slots]
            if queue:
                tok, choice = (torch.tensor(c) for c in zip(*queue))
                out = out.index_add(0, tok, expert(x[tok]) * w[tok, choice, None])
        return out


COMBOS = [(kind, k, cf, opt) for kind in ("labkit", "hand") for k in (1, 2)
          for cf in (0.75, 4.0) for opt in ("sgd", "adamw")]


def make_layer(kind, k, cf):
    torch.manual_seed(7)
    if kind == "labkit":
        return MoELayer(HIDDEN, 2 * HIDDEN, MoEConfig(experts=EXPERTS, top_k=k, capacity_factor=cf))
    return HandMoE(HIDDEN, EXPERTS, k, cf, frozen=kind == "frozen")


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, HIDDEN, generator=g)


def loss_of(kind, layer, out, y):
    loss = F.mse_loss(out, y)
    if kind == "labkit":     # labkit's layer (and the wrapper) have router losses: add them
        loss = loss + 0.01 * layer.aux_loss + 1e-3 * layer.z_loss
    return loss


def optimizer_for(params, opt):
    if opt == "sgd":
        return torch.optim.SGD(params, lr=0.1, foreach=False)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


@functools.lru_cache(maxsize=None)   # both world sizes compare with the same runs
def single_device(kind, k, cf, opt, dtype=torch.float32):
    layer = make_layer(kind, k, cf).to(dtype)
    optimizer = optimizer_for(layer.parameters(), opt)
    outs = []
    for step in range(STEPS):
        x, y = numerics.cast(batch(step), dtype)
        optimizer.zero_grad()
        out = layer(x)
        loss_of(kind, layer, out, y).backward()
        optimizer.step()
        outs.append(out.detach())
    return outs, {n: p.detach() for n, p in layer.named_parameters()}


def expert_parallel(combos, group=None):
    """Every combo on this rank with ExpertParallel; the replicated grads averaged here."""
    ctx = labkit.context()
    g = ctx.group(group)
    results = []
    for kind, k, cf, opt in combos:
        layer = labkit.ExpertParallel(make_layer(kind, k, cf), group=group)
        optimizer = optimizer_for(layer.parameters(), opt)
        outs, dropped = [], 0
        for step in range(STEPS):
            x, y = (t.chunk(g.size)[g.rank] for t in batch(step))
            optimizer.zero_grad()
            out = layer(x)
            loss_of(kind, layer, out, y).backward()
            for name, p in layer.named_parameters():   # the router is replicated: average it
                if ".experts." not in name and p.requires_grad:
                    ctx.comm.all_reduce(p.grad, op="avg", group=group, tag="router grads")
            optimizer.step()
            outs.append(out.detach())
            dropped += layer.routing["dropped"]
        results.append(dict(outs=outs, params=layer.full_state_dict(), dropped=dropped,
                            local=list(layer.local_experts)))
    return results


def errors(ctx):
    """The one-line errors, raised by the constructor before any collective."""
    said = []
    for experts, k in ((6, 1), (0, 1), (2, 3)):
        try:
            labkit.ExpertParallel(HandMoE(HIDDEN, experts, k, 1.0))
        except ValueError as error:
            said.append(str(error))
    return said


def in_launch(ctx, combos):
    return dict(runs=expert_parallel(combos), errors=errors(ctx))


def in_spawn(rank, world_size, combos):
    return dict(runs=expert_parallel(combos))


def in_subgroup(ctx, combos):
    odd = dist.new_group([1, 3])     # a torch ProcessGroup, made by every rank
    return expert_parallel(combos, group=odd) if ctx.rank in (1, 3) else None


def assert_equal_to_single_device(runs, combos):
    for combo, ranks in zip(combos, zip(*runs)):
        ref_outs, ref_params = single_device(*combo)
        exact_outs, exact_params = single_device(*combo, torch.float64)
        for step in range(STEPS):   # within rounding: labkit.numerics
            out = torch.cat([r["outs"][step] for r in ranks])
            agreement = numerics.compare(out, ref_outs[step], exact_outs[step])
            assert agreement, (combo, step, str(agreement))
        params = ranks[0]["params"]
        assert params.keys() == ref_params.keys()
        agreement = numerics.compare(params, ref_params, exact_params)
        assert agreement, (combo, str(agreement))
        initial = dict(make_layer(*combo[:3]).named_parameters())
        moved = max((ref_params[n] - p).abs().max().item() for n, p in initial.items())
        assert moved > 1e-3, combo                      # the steps did change the parameters
        assert all(torch.equal(params[n], p) for n, p in initial.items() if not p.requires_grad)
        dropped = sum(r["dropped"] for r in ranks)
        assert (dropped > 0) == (combo[2] < 1), (combo, dropped)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_single_device(world):
    results = launch(in_launch, world, COMBOS, timeout_s=300)
    assert_equal_to_single_device([r["runs"] for r in results], COMBOS)
    assert [r["runs"][0]["local"] for r in results] == [
        list(range(i * EXPERTS // world, (i + 1) * EXPERTS // world)) for i in range(world)]
    if world == 4:
        assert results[0]["errors"] == [
            "6 experts do not split evenly over 4 expert-parallel ranks: the number of experts "
            "must divide by the EP group size",
            "an MoE layer needs at least 1 expert, got 0",
            "top_k must be between 1 and the number of experts (2), got 3"]


@pytest.mark.numerics
def test_expert_parallel_in_a_plain_spawn_program():
    combos = [("labkit", 2, 0.75, "adamw"), ("hand", 1, 0.75, "sgd")]
    results = spawn(in_spawn, 2, combos)
    assert_equal_to_single_device([r["runs"] for r in results], combos)


def test_expert_parallel_in_a_subgroup_of_four():
    combos = [("labkit", 2, 0.75, "sgd"), ("frozen", 1, 0.75, "adamw")]
    results = launch(in_subgroup, 4, combos, timeout_s=300)
    assert results[0] is None and results[2] is None
    assert_equal_to_single_device([results[1], results[3]], combos)


# -------------------------------------------------------- the driver: report, CLI, inference

def test_report_equals_reference_with_expert_replicas():
    cfg = RunConfig(steps=3, global_batch=8, optimizer="sgd", lr=0.1, model_kwargs=TINY)
    rep = moe.report(4, cfg, experts=4, top_k=2, capacity_factor=1.0, ep=2)
    assert rep["config"]["dp"] == 2
    assert rep["agreement"]["params"]["ok"], rep["agreement"]["params"]["verdict"]
    assert rep["agreement"]["loss"]["ok"], rep["agreement"]["loss"]["verdict"]
    assert rep["tokens_dropped"] == rep["reference_tokens_dropped"]
    assert sum(rep["tokens_dropped"]) > 0
    # the comm log per op equals the accounting from routing counts and theory.time's formulas
    for op, predicted in rep["predicted_comm_by_op"].items():   # summed over the groups
        measured = sum(r["wire_bytes_per_rank"] for r in rep["comm"] if r["op"] == op)
        assert measured == pytest.approx(predicted), op
    for key in ("params", "grads"):   # the dense part + E/ep experts, fp32 SGD (no state)
        assert rep["memory"][0][key] == rep["predicted_memory"][key]


def test_cli_json_report(capsys):
    assert cli.main(["run", "moe", "--world-size", "2", "--experts", "4", "--top-k", "2",
                     "--capacity-factor", "1.25", "--layers", "2", "--hidden", "32", "--ffn",
                     "64", "--seq", "16", "--heads", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["technique"] == "moe" and len(out["tokens_dropped"]) == 3
    assert out["tokens_dropped"] == out["reference_tokens_dropped"]
    assert len(out["expert_load"][0]) == 4
    # Adam: the attention key bias (true gradient exactly 0) turns rounding noise into steps,
    # in the float32 reference too: judged against the float64 run (labkit.numerics)
    assert out["agreement"]["params"]["ok"], out["agreement"]["params"]["verdict"]


@pytest.mark.parametrize("argv,said", [
    (["--experts", "0"], "an MoE layer needs at least 1 expert, got 0"),
    (["--experts", "3"], "3 experts do not split evenly over 2 expert-parallel ranks"),
    (["--experts", "2", "--top-k", "3"], "top_k must be between 1 and the number of experts"),
    (["--ep", "3"], "the EP degree (3) must divide the world size (2)"),
    (["--world-size", "4", "--batch", "6"], "the global batch of 6 does not split into 4 ranks")])
def test_cli_says_one_line_before_ranks_start(capsys, argv, said):
    assert cli.main(["run", "moe", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1


def test_infer_equals_reference_and_moves_the_formula_bytes():
    cfg = RunConfig(model_kwargs=TINY)
    mc = MoEConfig(experts=4, top_k=2, capacity_factor=4.0)   # no drops: the balanced formula
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (4, TINY["seq"]), generator=g) for _ in range(2)]
    results = launch(moe.infer, 2, cfg, moe=mc, batches=batches)
    ref = moe.build_model(cfg, mc).eval()
    exact = numerics.exact_copy(ref)   # float64: what rounding is measured from
    with torch.no_grad():
        for i, tokens in enumerate(batches):
            got = torch.cat([r["outputs"][i] for r in results])
            verdict = numerics.compare(got, ref(tokens), exact(tokens))
            assert verdict, str(verdict)
    wire = sum(next(c["wire_bytes_per_rank"] for c in r["comm"] if c["op"] == "all_to_all")
               for r in results)
    per_rank = tmoe.all_to_all_bytes_per_rank(4 * TINY["seq"] / 2, 2, TINY["hidden"], 2,
                                              layers=TINY["layers"], training=False)
    assert wire == pytest.approx(2 * per_rank * len(batches))   # two ranks, every batch


# --------------------------------------------------------------- drops and load balancing

@pytest.mark.parametrize("skew,cf", [(0.0, 1.0), (1.0, 1.5)])
def test_tokens_dropped_match_theory(skew, cf):
    tokens, experts, trials = 256, 8, 200
    share = torch.tensor(tmoe.skewed_shares(experts, skew))
    g = torch.Generator().manual_seed(0)
    measured = []
    for _ in range(trials):   # Gumbel-max: argmax(log q + Gumbel) ~ Categorical(q)
        gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=g)))
        _, _, kept = reference_top_k_routing(share.log() + gumbel, 1,
                                             tmoe.capacity(tokens, experts, 1, cf))
        measured.append(int((~kept).sum()))
    expected = tmoe.expected_tokens_dropped(tokens, experts, 1, cf, skew)["dropped"]
    assert sum(measured) / trials == pytest.approx(expected, rel=0.1, abs=0.5)


def test_aux_loss_evens_out_expert_load():
    small = dict(layers=1, hidden=32, ffn=64, seq=16, heads=2)
    cfg = RunConfig(steps=60, lr=3e-2, global_batch=16, seed=0, model_kwargs=small)
    start, late = {}, {}
    for coef in (0.0, 1.0):
        mc = MoEConfig(experts=8, top_k=1, capacity_factor=4.0, aux_loss_coef=coef)
        run = moe.reference_train(cfg, mc)
        start[coef] = run["routing"][0]["load"][0]    # step 0: before any update
        late[coef] = tmoe.load_imbalance(tmoe.load_over_steps(run["routing"], range(50, 60)))
    assert start[0.0] == start[1.0]                   # the same model and batch at step 0
    # without the aux loss the router drifts away from even; with it the load stays nearer even
    assert late[0.0] > 1.15 * tmoe.load_imbalance(start[0.0]), (late, start)
    assert late[1.0] < 0.7 * late[0.0], late


# ------------------------------------------------------------------- exercise and theory

def test_checker_accepts_reference_and_names_mistakes():
    assert check_top_k_routing(reference_top_k_routing, verbose=False).ok

    def no_capacity(logits, k, capacity):
        e, w, kept = reference_top_k_routing(logits, k, capacity)
        return e, w, torch.ones_like(kept)

    def not_renormalised(logits, k, capacity):
        w, e = logits.softmax(-1).topk(k, dim=-1)
        return e, w, reference_top_k_routing(logits, k, capacity)[2]

    def token_major(logits, k, capacity):
        e, w, _ = reference_top_k_routing(logits, k, capacity)
        seen, kept = torch.zeros(logits.shape[1], dtype=torch.long), []
        for x in e.flatten().tolist():
            kept.append(bool(seen[x] < capacity))
            seen[x] += 1
        return e, w, torch.tensor(kept).view_as(e)

    assert check_top_k_routing(no_capacity, verbose=False).problem == "capacity"
    assert check_top_k_routing(not_renormalised, verbose=False).problem == "weights"
    assert check_top_k_routing(token_major, verbose=False).problem == "drop order"
    assert check_top_k_routing(lambda *a: 1 / 0, verbose=False).problem == "error"


def test_theory_mixtral_total_active_and_memory():
    s = tmoe.param_split("mixtral-8x7b")
    assert s["total"] == pytest.approx(46.7e9, rel=0.01)
    assert s["active"] == pytest.approx(12.9e9, rel=0.01)
    f = tmoe.flops_per_token("mixtral-8x7b")
    assert f["active"] == 2 * s["active"] and f["ratio"] == pytest.approx(3.6, rel=0.02)
    m1, m8 = tmoe.memory_per_gpu("mixtral-8x7b", 1), tmoe.memory_per_gpu("mixtral-8x7b", 8)
    assert m1["total"] == pytest.approx(2 * s["total"])
    assert m8["total"] == pytest.approx(2 * (s["dense"] + s["experts"] / 8))
