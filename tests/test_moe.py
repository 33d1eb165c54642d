"""Mixture of Experts: routing, capacity and drops; expert parallelism equals one process;
all-to-all bytes equal the formula; the aux loss evens out the load; the exercise checker."""
import json

import pytest
import torch

from labkit import cli, moe
from labkit.models import (MoEConfig, MoELayer, choice_counts, queue_offsets,
                           queue_positions)
from labkit.runs.reference import RunConfig
from labkit.runtime.launch import launch
from labkit.theory import moe as tmoe

TINY = dict(layers=2, hidden=32, ffn=64, seq=16, heads=2)
CFG = RunConfig(steps=2, global_batch=8, model_kwargs=TINY)


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
    x = torch.randn(64, 16)
    out = layer(x)
    r = layer.last[0]
    assert r.capacity == 8 == tmoe.capacity(64, 4, 1, 0.5)
    assert torch.bincount(r.expert[r.kept], minlength=4).max() <= r.capacity
    assert r.dropped == int((r.group_load - r.capacity).clamp(min=0).sum()) > 0
    dropped_tokens = (~r.kept).all(dim=1)
    assert torch.equal(out[dropped_tokens], torch.zeros_like(out[dropped_tokens]))  # residual only
    assert (out[~dropped_tokens].abs().sum(dim=1) > 0).all()


@pytest.mark.parametrize("k", [1, 2])
def test_capacity_dispatch_equals_dense_dispatch_when_nothing_is_dropped(k):
    torch.manual_seed(1)
    layer = MoELayer(16, 32, MoEConfig(experts=4, top_k=k, capacity_factor=4.0))
    x = torch.randn(48, 16)
    sparse = layer(x)
    assert layer.last[0].dropped == 0
    dense = layer.dense_forward(x)
    assert torch.allclose(sparse, dense, atol=1e-6)


def test_top2_weights_renormalised_top1_raw_probability():
    logits = torch.randn(10, 4)
    from labkit.models import top_k_gates
    probs, e1, w1 = top_k_gates(logits, 1)
    assert torch.allclose(w1[:, 0], probs.max(dim=-1).values)
    _, _, w2 = top_k_gates(logits, 2)
    assert torch.allclose(w2.sum(-1), torch.ones(10))


# ------------------------------------------------------- expert parallelism == one process

@pytest.mark.parametrize("k", [1, 2])
def test_expert_parallel_outputs_loss_grads_equal_reference(k):
    for cf in (1.0, 8.0):   # 1.0 drops tokens; 8.0 drops none and must equal dense dispatch too
        mc = MoEConfig(experts=4, top_k=k, capacity_factor=cf)
        ref = moe.reference_forward_backward(CFG, mc)
        if cf == 1.0:
            assert ref["routing"]["dropped"] > 0
        for n in (1, 2, 4):
            res = launch(moe.forward_backward, n, CFG, moe=mc)
            logits = torch.cat([r["logits"] for r in res])
            assert torch.allclose(logits, ref["logits"], atol=1e-5), (k, cf, n)
            assert abs(sum(r["loss"] for r in res) / n - ref["loss"]) < 1e-5
            assert sum(r["routing"]["dropped"] for r in res) == ref["routing"]["dropped"]
            grads = res[0]["grads"]
            assert grads.keys() == ref["grads"].keys()
            for name, g in ref["grads"].items():
                assert torch.allclose(grads[name], g, atol=1e-6, equal_nan=True), (name, n)
        if cf == 8.0:
            dense = moe.reference_forward_backward(CFG, MoEConfig(experts=4, top_k=k,
                                                                  dense=True))
            assert torch.allclose(ref["logits"], dense["logits"], atol=1e-5)
            assert abs(ref["loss"] - dense["loss"]) < 1e-5


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_training_equals_reference_sgd(world, ep):
    cfg = RunConfig(steps=3, global_batch=8, optimizer="sgd", lr=0.1, model_kwargs=TINY)
    rep = moe.report(world, cfg, experts=4, top_k=2, capacity_factor=1.0, ep=ep)
    assert rep["max_param_diff_vs_reference"] < 1e-5
    assert max(abs(a - b) for a, b in zip(rep["loss"], rep["reference_loss"])) < 1e-5
    assert rep["tokens_dropped"] == rep["reference_tokens_dropped"]
    assert sum(rep["tokens_dropped"]) > 0
    # comm per op equals the accounting from routing counts and theory.time formulas
    for row in rep["comm"]:
        assert row["wire_bytes_per_rank"] == pytest.approx(rep["predicted_comm_by_op"][row["op"]])
    # memory: the dense part + E/ep experts, fp32 SGD (no state)
    for key in ("params", "grads"):
        assert rep["memory"][0][key] == rep["predicted_memory"][key]


def test_training_equals_reference_adam_except_key_bias():
    """Adam divides by sqrt(v): the attention *key* bias has an exactly-zero true gradient
    (softmax ignores a shift of a row of scores), so its ~1e-11 rounding noise becomes an
    lr-sized step. Every other parameter must match to float32 tolerance."""
    cfg = RunConfig(steps=3, global_batch=8, model_kwargs=TINY)
    mc = MoEConfig(experts=4, top_k=1, capacity_factor=1.0)
    res = launch(moe.train, 2, cfg, moe=mc)
    ref = moe.reference_train(cfg, mc)
    h = TINY["hidden"]
    for name, p in ref["params"].items():
        got = res[0]["params"][name]
        if name.endswith("attn.qkv.bias"):
            got, p = torch.cat([got[:h], got[2 * h:]]), torch.cat([p[:h], p[2 * h:]])
        assert (got - p).abs().max() < 1e-5, name


# ------------------------------------------------------------------------ all-to-all bytes

def test_all_to_all_bytes_equal_formula():
    n, k, steps = 4, 2, 2
    cfg = RunConfig(steps=steps, global_batch=8, optimizer="sgd", model_kwargs=TINY)
    mc = MoEConfig(experts=4, top_k=k, capacity_factor=8.0)   # no drops: the balanced formula
    res = launch(moe.train, n, cfg, moe=mc)
    h, layers, tokens = TINY["hidden"], TINY["layers"], 8 * TINY["seq"]
    total = 0.0
    for r in res:
        row = next(c for c in r["comm"] if c["op"] == "all_to_all")
        assert row["calls"] == 4 * layers * steps     # 2 forward + 2 backward per layer-step
        rows = sum(sum(s["sent"]) + sum(s["received"]) for s in r["routing"])
        assert row["wire_bytes_per_rank"] == pytest.approx(
            2 * (n - 1) / n * rows * h * 4)          # (N-1)/N of every tensor handed in
        total += row["wire_bytes_per_rank"]
    assert sum(r["routing"][0]["dropped"] for r in res) == 0
    expected = tmoe.all_to_all_bytes_per_rank(tokens / n, k, h, n, layers=layers) * steps
    assert total / n == pytest.approx(expected)      # the mean rank moves exactly the formula


# --------------------------------------------------------------- drops and load balancing

@pytest.mark.parametrize("skew,cf", [(0.0, 1.0), (1.0, 1.5), (0.5, 1.25)])
def test_tokens_dropped_match_theory(skew, cf):
    tokens, experts, trials = 256, 8, 200
    share = torch.tensor(tmoe.skewed_shares(experts, skew))
    g = torch.Generator().manual_seed(0)
    measured = []
    for _ in range(trials):   # Gumbel-max: argmax(log q + Gumbel) ~ Categorical(q)
        gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=g)))
        _, _, kept = moe.reference_top_k_routing(share.log() + gumbel, 1,
                                                 tmoe.capacity(tokens, experts, 1, cf))
        measured.append(int((~kept).sum()))
    expected = tmoe.expected_tokens_dropped(tokens, experts, 1, cf, skew)["dropped"]
    mean = sum(measured) / trials
    assert mean == pytest.approx(expected, rel=0.1, abs=0.5)


def test_aux_loss_evens_out_expert_load():
    small = dict(layers=1, hidden=32, ffn=64, seq=16, heads=2)
    cfg = RunConfig(steps=60, lr=3e-2, global_batch=16, seed=0, model_kwargs=small)
    late = range(50, 60)
    imbalance, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matmuls: one thread is faster on shared cores
    for coef in (0.0, 1.0):
        mc = MoEConfig(experts=8, top_k=1, capacity_factor=4.0, aux_loss_coef=coef)
        run = moe.reference_train(cfg, mc)
        imbalance[coef] = moe.load_imbalance(moe.load_over_steps(run["routing"], late))
        before = moe.load_imbalance(moe.load_over_steps(run["routing"], range(0, 5)))
    torch.set_num_threads(threads)
    # without the aux loss the router piles tokens on a few experts; with it the load stays even
    assert imbalance[0.0] > 1.5 * before, (imbalance, before)
    assert imbalance[1.0] < 0.7 * imbalance[0.0], imbalance


# ------------------------------------------------------------------- exercise and report

def test_checker_accepts_reference_and_names_mistakes():
    assert moe.check_top_k_routing(moe.reference_top_k_routing, verbose=False).ok

    def no_capacity(logits, k, capacity):
        e, w, kept = moe.reference_top_k_routing(logits, k, capacity)
        return e, w, torch.ones_like(kept)

    def not_renormalised(logits, k, capacity):
        p = logits.softmax(-1)
        w, e = p.topk(k, dim=-1)
        return e, w, moe.reference_top_k_routing(logits, k, capacity)[2]

    def token_major(logits, k, capacity):
        e, w, _ = moe.reference_top_k_routing(logits, k, capacity)
        flat = e.flatten()
        seen = torch.zeros(logits.shape[1], dtype=torch.long)
        kept = []
        for x in flat.tolist():
            kept.append(bool(seen[x] < capacity))
            seen[x] += 1
        return e, w, torch.tensor(kept).view_as(e)

    assert moe.check_top_k_routing(no_capacity, verbose=False).problem == "capacity"
    assert moe.check_top_k_routing(not_renormalised, verbose=False).problem == "weights"
    assert moe.check_top_k_routing(token_major, verbose=False).problem == "drop order"
    assert moe.check_top_k_routing(lambda *a: 1 / 0, verbose=False).problem == "error"


def test_cli_json_report(capsys):
    cli.main(["run", "moe", "--world-size", "2", "--experts", "4", "--top-k", "2",
              "--capacity-factor", "1.0", "--steps", "2", "--optimizer", "sgd", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["technique"] == "moe" and len(out["tokens_dropped"]) == 2
    assert len(out["expert_load"][0]) == 4 and out["max_param_diff_vs_reference"] < 1e-5


def test_theory_mixtral_total_active_and_memory():
    s = tmoe.param_split("mixtral-8x7b")
    assert s["total"] == pytest.approx(46.7e9, rel=0.01)
    assert s["active"] == pytest.approx(12.9e9, rel=0.01)
    f = tmoe.flops_per_token("mixtral-8x7b")
    assert f["active"] == 2 * s["active"] and f["ratio"] == pytest.approx(3.6, rel=0.02)
    m1, m8 = tmoe.memory_per_gpu("mixtral-8x7b", 1), tmoe.memory_per_gpu("mixtral-8x7b", 8)
    assert m1["total"] == pytest.approx(2 * s["total"])
    assert m8["total"] == pytest.approx(2 * (s["dense"] + s["experts"] / 8))
    rows = tmoe.claim_8_table()
    assert {r["phase"] for r in rows} == {"prefill", "decode"} and len(rows) == 8
