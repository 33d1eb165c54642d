"""Data parallelism: the `DataParallel` block on models it was not written for (an nn.Sequential
with a frozen bias, tied weights, a parameter on the root module, labkit's GPT), with SGD and
AdamW on 2 and 4 ranks, in a plain mp.spawn program and inside the sub-group {1,3} of 4 ranks;
then the lesson's driver (modes, bytes on the wire, overlap on the modelled clock), the ring
from send/recv, the exercise checker's verdicts, inference, and the CLI."""
import copy
import json
import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import models, numerics
from labkit.exercises.data_parallel import check_ring_all_reduce
from labkit.parallel.data_parallel import ring_all_reduce
from labkit.runs import data_parallel as dp
from labkit.runs import reference
from labkit.theory import data_parallel as theory_dp
from spawn_helpers import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, BATCH = 3, 8


# ---------------------------------------------------------------- models the block never saw

class TiedLM(nn.Module):
    """Embedding and output layer share one weight: one Parameter reached twice."""

    def __init__(self, vocab=12, hidden=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(F.gelu(self.mid(self.emb(x))))


class RootScale(nn.Module):
    """A parameter that sits on the root module itself, not on a child."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        return self.body(x) * self.scale


def mlp_frozen_bias():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                          nn.Linear(16, 4))
    model[2].bias.requires_grad_(False)
    model.register_buffer("offset", torch.randn(4))   # a buffer the broadcast must cover
    return model


def gpt():
    return models.build("gpt", seed=0, layers=1, hidden=16, heads=2, ffn=32, seq=8, vocab=16)


def mse(model, x, y):
    return F.mse_loss(model(x), y)


def next_token(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


MODELS = {  # name -> (build, loss, kind of data)
    "mlp_frozen_bias": (mlp_frozen_bias, mse, "regression"),
    "tied": (TiedLM, next_token, "tokens12"),
    "root_param": (RootScale, mse, "regression"),
    "gpt": (gpt, lambda m, x, y: m(x, y), "tokens16"),
}
# AdamW's eps is 1e-5: the GPT's attention key bias has a true gradient of exactly 0 (softmax
# ignores a constant shift of a row of scores), so backward computes rounding noise (~1e-10) for
# it, which differs between any two summation orders; the default 1e-8 would turn that noise into
# lr-sized steps (measured: 2.7e-4 apart after 3 steps), 1e-5 keeps them ~1e-7.
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5),
}


def global_batch(kind, step):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "regression":
        return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
    vocab = int(kind[len("tokens"):])
    tokens = torch.randint(0, vocab, (BATCH, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def cases():
    """Every model with both optimizers, then the variants on two of them."""
    out = [(m, o, {}) for m in MODELS for o in OPTIMIZERS]
    for m in ("mlp_frozen_bias", "gpt"):
        out += [(m, "adamw", dict(bucket_mb=0)), (m, "adamw", dict(overlap=False)),
                (m, "sgd", dict(accumulate=2)), (m, "adamw", dict(accumulate=2))]
    return out


def train_cases(ctx, group, todo):
    """On each case: DataParallel over `group` on this rank's shard against one device on the
    full batch (computed here too). Returns, per case, the largest parameter difference, the
    bytes the buckets all-reduced and the bytes of the distinct trainable parameters."""
    g = ctx.group(group)
    out = []
    for name, opt_name, options in todo:
        build, loss_fn, kind = MODELS[name]
        torch.manual_seed(0)
        model = build()
        single = copy.deepcopy(model)
        exact = numerics.exact_copy(model)   # the float64 run: what rounding is measured from
        frozen = {n: p.detach().clone() for n, p in model.named_parameters()
                  if not p.requires_grad}
        accumulate = options.get("accumulate", 1)
        wrapped = labkit.DataParallel(model, group=group, bucket_mb=options.get("bucket_mb", 1e-3),
                                      overlap=options.get("overlap", True))
        optimizer = OPTIMIZERS[opt_name](wrapped.parameters())
        references = [(m, OPTIMIZERS[opt_name](m.parameters())) for m in (single, exact)]
        before = reduced_bytes(ctx)
        for step in range(STEPS):
            x, y = global_batch(kind, step)
            for m, opt in references:
                opt.zero_grad()
                loss_fn(m, *numerics.cast((x, y), numerics.dtype_of(m))).backward()
                opt.step()
            size = BATCH // g.size
            xs, ys = (t[g.rank * size:(g.rank + 1) * size] for t in (x, y))
            optimizer.zero_grad(set_to_none=True)
            for k, (mx, my) in enumerate(zip(xs.chunk(accumulate), ys.chunk(accumulate))):
                with wrapped.no_sync() if k < accumulate - 1 else nullcontext():
                    (loss_fn(wrapped, mx, my) / accumulate).backward()
            wrapped.finish_gradient_synchronization()   # done already: must be harmless
            optimizer.step()
        mine = dict(model.named_parameters())
        out.append(dict(
            case=f"{name}/{opt_name}/{options}",
            agreement=numerics.compare(mine, dict(single.named_parameters()),
                                       dict(exact.named_parameters())),
            frozen_kept=all(torch.equal(mine[k], v) and mine[k].grad is None
                            for k, v in frozen.items()),
            reduced=reduced_bytes(ctx) - before,
            expected=STEPS * 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)))
    return out


def reduced_bytes(ctx):
    return sum(row["bytes"] for row in ctx.comm.summary(by=("op", "tag"))
               if row["op"] == "all_reduce" and row["tag"].startswith("bucket"))


def assert_matches_one_device(results):
    for r in results:
        assert r["agreement"], (r["case"], str(r["agreement"]))   # within rounding
        assert r["frozen_kept"], r["case"]          # frozen: not touched, no gradient
        assert r["reduced"] == r["expected"], r["case"]   # tied: reduced once; frozen: never


# ------------------------------------------------------------------------ the block itself

class SometimesUsed(nn.Module):
    """`extra` gets a gradient on one rank only, `never` on none."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.extra = nn.Parameter(torch.ones(3))
        self.never = nn.Linear(2, 2)

    def forward(self, x, use_extra):
        out = self.body(x).square().mean()
        return out + 2 * self.extra.sum() if use_extra else out


def unused_check(ctx, bucket_mb):
    """A rank whose backward never reached a parameter joins its all-reduce with zeros: the
    gradient averages to (2 + 0 + ...) / N, and to 0 for the one no rank used."""
    torch.manual_seed(0)
    model = labkit.DataParallel(SometimesUsed(), bucket_mb=bucket_mb)
    model(torch.ones(2, 4) * (ctx.rank + 1), use_extra=ctx.rank == 1).backward()
    return dict(extra=model.module.extra.grad, never=model.module.never.weight.grad,
                body=model.module.body.weight.grad)


def under_launch(ctx, todo):
    return dict(cases=train_cases(ctx, None, todo), broadcast=broadcast_check(ctx, None),
                unused=[unused_check(ctx, mb) for mb in (25.0, 0)])


def broadcast_check(ctx, group):
    """Replicas initialised differently (seed = global rank) end up with member 0's weights,
    buffers included, and building the wrapper leaves the caller's RNG state alone."""
    torch.manual_seed(ctx.rank)
    model = mlp_frozen_bias()
    state = torch.get_rng_state()
    labkit.DataParallel(model, group=group)
    same_rng = torch.equal(state, torch.get_rng_state())
    return dict(same_rng=same_rng, state={k: v.clone() for k, v in model.state_dict().items()})


def expected_state(seed):
    torch.manual_seed(seed)
    return mlp_frozen_bias().state_dict()


@pytest.mark.numerics
@pytest.mark.parametrize("n", [2, 4])
def test_block_matches_one_device_on_any_model(n):
    results = labkit.launch(under_launch, n, cases(), timeout_s=300)
    for r in results:
        assert_matches_one_device(r["cases"])
    want = expected_state(0)   # member 0 of the world is rank 0
    for r in results:
        assert r["broadcast"]["same_rng"]
        for k, v in want.items():
            assert torch.equal(r["broadcast"]["state"][k], v), k
    assert not torch.equal(expected_state(1)["0.weight"], want["0.weight"])  # they did differ
    for k in range(2):
        got = [r["unused"][k] for r in results]
        for r in got:
            assert torch.allclose(r["extra"], torch.full((3,), 2.0 / n))
            assert torch.equal(r["never"], torch.zeros(2, 2))
            assert torch.equal(r["body"], got[0]["body"])   # the same average everywhere


def _spawned(rank, world_size, todo):
    return train_cases(labkit.context(), None, todo)   # a learner's own mp.spawn program


def test_block_in_a_plain_spawn_program():
    todo = [("mlp_frozen_bias", "adamw", {}), ("tied", "sgd", dict(accumulate=2)),
            ("root_param", "adamw", dict(bucket_mb=0))]
    for results in spawn(_spawned, 2, todo):
        assert_matches_one_device(results)


def in_subgroup(ctx, todo):
    """DP over ranks {1,3} of 4, while ranks 0 and 2 all-reduce in their own group."""
    odd, even = ctx.new_group([1, 3]), ctx.new_group([0, 2])
    if odd is None:
        t = torch.full((3,), float(ctx.rank))
        for _ in range(5):
            ctx.comm.all_reduce(t, group=even, tag="elsewhere")
        return dict(elsewhere=t)
    ring = ring_all_reduce(ctx, torch.arange(6.0) * (ctx.rank + 1), group=odd)
    return dict(cases=train_cases(ctx, odd, todo), broadcast=broadcast_check(ctx, odd),
                ring=ring)


def test_block_inside_a_sub_group():
    todo = [("mlp_frozen_bias", "sgd", {}), ("gpt", "adamw", {}),
            ("tied", "adamw", dict(overlap=False))]
    results = labkit.launch(in_subgroup, 4, todo, timeout_s=300)
    want = expected_state(1)   # member 0 of {1,3} is rank 1
    for rank in (1, 3):
        assert_matches_one_device(results[rank]["cases"])
        assert torch.equal(results[rank]["broadcast"]["state"]["0.weight"], want["0.weight"])
        assert torch.equal(results[rank]["ring"], torch.arange(6.0) * (2 + 4))
    for rank in (0, 2):
        assert torch.equal(results[rank]["elsewhere"], torch.full((3,), 2.0 ** 5))


# ------------------------------------------------------------------------------ the driver

MODES = {  # name -> train() keyword arguments
    "naive": dict(mode="naive"),
    "bucketed": dict(mode="bucketed", bucket_mb=0.1, overlap=True),
    "no-overlap": dict(mode="bucketed", bucket_mb=0.1, overlap=False),
    "accumulate-2": dict(mode="bucketed", bucket_mb=0.1, accumulate=2),
}
SGD = reference.RunConfig(steps=2, global_batch=8, optimizer="sgd")


@pytest.fixture(scope="module")
def sgd_reference():
    return reference.train(SGD), reference.float64_reference(SGD)


@pytest.mark.parametrize("mode", list(MODES))
def test_driver_modes_match_the_reference_and_the_ring_formula(mode, sgd_reference):
    n = 4 if mode == "bucketed" else 2
    results = labkit.launch(dp.train, n, SGD, **MODES[mode])
    single, exact = sgd_reference
    assert numerics.compare(results[0]["params"], single["params"], exact["params"])
    assert numerics.compare_loss(dp.global_loss(results), single["loss"], exact["loss"])
    assert results[0]["local_loss"] != pytest.approx(results[1]["local_loss"], abs=1e-6)
    rows = [row for row in results[0]["comm"] if row["op"] == "all_reduce"]
    grad_bytes = theory_dp.gradient_bytes(reference.build_model(SGD))
    wire = sum(row["wire_bytes_per_rank"] for row in rows)
    assert wire == pytest.approx(2 * (n - 1) / n * grad_bytes * SGD.steps, rel=1e-12)
    assert sum(row["bytes"] for row in rows) == grad_bytes * SGD.steps   # each byte once
    calls = sum(row["calls"] for row in rows) / SGD.steps
    params = len(list(reference.build_model(SGD).parameters()))
    assert calls == params if mode == "naive" else 2 <= calls < params   # a few buckets


def test_overlap_shortens_the_modelled_step():
    # hidden 128 and 32 sequences: backward is long enough for buckets to hide under it
    cfg = reference.RunConfig(steps=2, global_batch=32, model_kwargs=dict(hidden=128))
    on, off = (labkit.launch(dp.train, 2, cfg, bucket_mb=0.25, overlap=o)[0] for o in (1, 0))
    t_on, t_off = on["modelled_step_s"][-1], off["modelled_step_s"][-1]
    backward = [e for e in on["timeline"] if e["kind"] == "compute" and e["name"] == "backward"]
    compute_per_step = sum(e["end"] - e["start"] for e in backward) / cfg.steps
    assert t_off - t_on > 0.3 * compute_per_step   # a real share of backward is hidden
    comm = [e for e in on["timeline"] if e["lane"] == "comm"]
    assert any(b["start"] <= c["start"] < b["end"] for b in backward for c in comm)
    comm_off = [e for e in off["timeline"] if e["kind"] == "comm" and e["name"] == "all_reduce"]
    backward_off = [e for e in off["timeline"]
                    if e["kind"] == "compute" and e["name"] == "backward"]
    assert comm_off and not any(b["start"] < c["start"] < b["end"] * (1 - 1e-12)
                                for b in backward_off for c in comm_off)
    assert reference.max_param_diff(on["params"], off["params"]) == 0.0


def ring_vs_all_reduce(ctx, numel):
    t = torch.arange(numel, dtype=torch.float32) * (ctx.rank + 1) + 0.25 * ctx.rank
    mine = ring_all_reduce(ctx, t.clone())
    sent = sum(r.wire_bytes_per_rank for r in ctx.comm.records if r.op == "send")
    return mine, ctx.comm.all_reduce(t.clone()), sent


@pytest.mark.parametrize("n", [3, 4])
def test_ring_all_reduce_from_send_recv_equals_all_reduce(n):
    for mine, theirs, sent in labkit.launch(ring_vs_all_reduce, n, 24):
        assert torch.equal(mine, theirs)
        assert sent == pytest.approx(2 * (n - 1) / n * 24 * 4)


def recv_first(ctx, tensor):
    n = ctx.world_size
    incoming = torch.empty_like(tensor)
    ctx.comm.recv(incoming, (ctx.rank - 1) % n)   # everybody waits here: nobody sends
    ctx.comm.send(tensor, (ctx.rank + 1) % n)
    return tensor + incoming


def reduce_scatter_only(ctx, tensor):
    """Half a ring: each rank ends with one finished chunk and partial sums elsewhere."""
    n, r = ctx.world_size, ctx.rank
    chunks = list(torch.tensor_split(tensor, n))
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        handle = ctx.comm.send(chunks[(r - s) % n], (r + 1) % n, async_op=True)
        ctx.comm.recv(incoming, (r - 1) % n)
        handle.wait()
        chunks[(r - s - 1) % n].add_(incoming)
    return tensor


def test_the_checker_accepts_the_ring_and_explains_mistakes(capsys):
    ok = check_ring_all_reduce(ring_all_reduce)
    assert ok and ok.problem == "" and "96 bytes" in ok.message
    half = check_ring_all_reduce(reduce_scatter_only)
    assert not half and half.problem == "wrong chunk"
    assert "chunks [1] right" in half.message and "all-gather" in half.message
    stuck = check_ring_all_reduce(recv_first, timeout_s=5)
    assert not stuck and stuck.problem == "deadlock"
    assert "async_op=True" in stuck.message   # and, when the ranks got there, where they wait
    assert "rank 0: recv from rank 3" in stuck.message or "not in a" in stuck.message
    assert "Deadlock" in capsys.readouterr().out   # the verdicts are printed for the learner


def test_inference_one_batch_per_replica():
    cfg = reference.RunConfig()
    model = reference.build_model(cfg).eval()
    batches = [reference.batch(model, cfg, i)[0] for i in range(3)]
    results = labkit.launch(dp.infer, 2, cfg, batches)
    outputs = {i: out for r in results for i, out in r["outputs"].items()}
    assert sorted(outputs) == [0, 1, 2] and sorted(results[1]["outputs"]) == [1]
    exact = numerics.exact_copy(model)   # float64: what rounding is measured from
    with torch.no_grad():
        for i, x in enumerate(batches):
            assert numerics.compare(outputs[i], model(x), exact(x))
    # rank 0 ran two batches one after the other, rank 1 one: the second replica idles half
    assert results[0]["finished_s"] == pytest.approx(2 * results[1]["finished_s"])
    one = theory_dp.inference_throughput(2.6, replicas=1, batches=2)
    two = theory_dp.inference_throughput(2.6, replicas=2, batches=2)
    assert two["seconds_per_batch"] == pytest.approx(1.3) and two["latency_s"] == 2.6
    assert two["throughput_per_s"] == pytest.approx(2 * one["throughput_per_s"])
    lone = theory_dp.inference_throughput(2.6, replicas=2, batches=1)   # one batch: no gain at all
    assert lone["makespan_s"] == pytest.approx(2.6) and lone["utilisation"] == 0.5


def labkit_cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "labkit", "run", "dp", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_cli_prints_the_json_report():
    out = labkit_cli("--world-size", "2", "--steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    keys = {"technique", "world_size", "backend", "config", "steps", "loss", "reference_loss",
            "max_param_diff_vs_reference", "memory", "predicted_memory", "comm",
            "predicted_comm_bytes_per_rank", "wall_s", "modelled_step_s"}
    assert keys <= set(report)
    assert report["technique"] == "dp" and report["world_size"] == 2
    assert report["config"]["mode"] == "bucketed" and report["config"]["overlap"] is True
    assert report["agreement"]["loss"]["ok"] and report["agreement"]["params"]["ok"], \
        report["agreement"]
    row = next(r for r in report["comm"] if r["op"] == "all_reduce")
    assert row["wire_bytes_per_rank"] == pytest.approx(report["predicted_comm_bytes_per_rank"])
    memory, predicted = report["memory"]["0"], report["predicted_memory"]
    assert set(report["memory"]) == {"0", "1"}
    assert memory["params"] == predicted["params"]
    assert memory["buffers"] == predicted["buffers"]   # the buckets: one copy of the grads
    # each rank saves activations for its own half of the batch (theory/ within a few percent)
    assert memory["activations"] == pytest.approx(predicted["activations"], rel=0.05)


def test_cli_refuses_a_batch_that_does_not_split_in_one_line():
    out = labkit_cli("--world-size", "3")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: the global batch of 8")
