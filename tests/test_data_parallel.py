"""Data parallelism (labkit.data_parallel): same parameters as the single-device reference in
every mode, wire bytes = 2(N-1)/N x gradient bytes, overlap shortens the modelled step, the ring
from send/recv equals all_reduce, the exercise checker's verdicts, inference, and the CLI."""
import json
import os
import subprocess
import sys

import pytest
import torch

import labkit
from labkit import data_parallel as dp
from labkit.runs import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {  # name -> train() keyword arguments
    "naive": dict(mode="naive"),
    "bucketed": dict(mode="bucketed", bucket_mb=0.1, overlap=True),
    "no-overlap": dict(mode="bucketed", bucket_mb=0.1, overlap=False),
    "accumulate-2": dict(mode="bucketed", bucket_mb=0.1, accumulate=2),
}
# SGD: the update is linear in the gradient, so float32 rounding of the gradient sum stays
# ~1e-9 in the parameters. (Adam divides by sqrt(v): see the key-bias test below.)
SGD = reference.RunConfig(steps=2, global_batch=8, optimizer="sgd")
_REFERENCES = {}


def ref(cfg):
    key = repr(cfg)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference.train(cfg)
    return _REFERENCES[key]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_mode_matches_the_single_device_reference(n, mode):
    results = labkit.launch(dp.train, n, SGD, **MODES[mode])
    expected = ref(SGD)
    assert reference.max_param_diff(results[0]["params"], expected["params"]) < 1e-5
    assert dp.global_loss(results) == pytest.approx(expected["loss"], abs=1e-5)
    if n > 1:  # each rank's own loss is its shard's, not the full batch's
        assert results[0]["local_loss"] != pytest.approx(results[1]["local_loss"], abs=1e-6)
    # wire bytes per rank: 2(N-1)/N x gradient bytes x steps, from the comm log
    wire = sum(row["wire_bytes_per_rank"] for row in results[0]["comm"]
               if row["op"] == "all_reduce")
    grad_bytes = dp.gradient_bytes(SGD)
    assert wire == pytest.approx(2 * (n - 1) / n * grad_bytes * SGD.steps, rel=1e-12)
    payload = sum(row["bytes"] for row in results[0]["comm"] if row["op"] == "all_reduce")
    assert payload == grad_bytes * SGD.steps   # every gradient byte reduced once per step
    calls = sum(row["calls"] for row in results[0]["comm"] if row["op"] == "all_reduce")
    params = len(list(reference.build_model(SGD).parameters()))
    if mode == "naive":
        assert calls == params * SGD.steps      # one call per parameter tensor
    else:
        assert 2 <= calls / SGD.steps < params  # a few buckets


def test_adam_matches_the_reference_except_the_redundant_key_bias():
    # The attention key bias adds the same number to every score of a row, which softmax
    # cancels: its true gradient is 0 and what backward computes is rounding noise (~1e-10).
    # Adam normalises that noise to steps of ~lr, so it differs between any two summation
    # orders (even accumulate=2 on one rank). Everything else must match to float32 rounding.
    cfg = reference.RunConfig(steps=2, global_batch=8)
    results = labkit.launch(dp.train, 2, cfg, bucket_mb=0.1)
    expected = ref(cfg)
    h = reference.build_model(cfg).cfg.hidden
    worst = 0.0
    for name, p in results[0]["params"].items():
        q = expected["params"][name]
        if name.endswith("attn.qkv.bias"):
            p, q = torch.cat([p[:h], p[2 * h:]]), torch.cat([q[:h], q[2 * h:]])
        worst = max(worst, (p - q).abs().max().item())
    assert worst < 1e-5
    assert dp.global_loss(results) == pytest.approx(expected["loss"], abs=1e-5)


def step_and_compute(cfg, overlap, bucket_mb):
    return labkit.launch(dp.train, 2, cfg, bucket_mb=bucket_mb, overlap=overlap)[0]


def test_overlap_shortens_the_modelled_step():
    # hidden 128 and a 32-sequence batch: backward is long enough for buckets to hide under it
    cfg = reference.RunConfig(steps=2, global_batch=32, model_kwargs=dict(hidden=128))
    with_overlap = step_and_compute(cfg, True, 0.25)
    without = step_and_compute(cfg, False, 0.25)
    t_on, t_off = with_overlap["modelled_step_s"][-1], without["modelled_step_s"][-1]
    backward = [e for e in with_overlap["timeline"]
                if e["kind"] == "compute" and e["name"] == "backward"]
    compute_per_step = sum(e["end"] - e["start"] for e in backward) / cfg.steps
    assert t_on < t_off
    assert t_off - t_on > 0.3 * compute_per_step   # a real share of backward is hidden
    # with overlap, buckets' all-reduces run on the comm lane while backward still computes
    comm = [e for e in with_overlap["timeline"] if e["lane"] == "comm"]
    assert any(b["start"] <= c["start"] < b["end"] for b in backward for c in comm)
    # without, no all-reduce starts inside a backward bar
    comm_off = [e for e in without["timeline"] if e["kind"] == "comm"]
    backward_off = [e for e in without["timeline"]
                    if e["kind"] == "compute" and e["name"] == "backward"]
    assert comm_off and not any(b["start"] < c["start"] < b["end"] * (1 - 1e-12)
                                for b in backward_off for c in comm_off)
    # the same parameters either way
    assert reference.max_param_diff(with_overlap["params"], without["params"]) == 0.0


def ring_vs_all_reduce(ctx, numel):
    t = torch.arange(numel, dtype=torch.float32) * (ctx.rank + 1) + 0.25 * ctx.rank
    mine = dp.ring_all_reduce(ctx, t.clone())
    sent = sum(r.wire_bytes_per_rank for r in ctx.comm.records if r.op == "send")
    theirs = ctx.comm.all_reduce(t.clone())
    return mine, theirs, sent


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_all_reduce_from_send_recv_equals_all_reduce(n):
    numel = 24
    for mine, theirs, sent in labkit.launch(ring_vs_all_reduce, n, numel):
        assert torch.equal(mine, theirs)
        assert sent == pytest.approx(2 * (n - 1) / n * numel * 4)


def wrong_sum(ctx, tensor):
    return tensor * ctx.world_size  # "every rank has the same data", which is not true


def recv_first(ctx, tensor):
    n = ctx.world_size
    incoming = torch.empty_like(tensor)
    ctx.comm.recv(incoming, (ctx.rank - 1) % n)   # everybody waits here: nobody sends
    ctx.comm.send(tensor, (ctx.rank + 1) % n)
    return tensor + incoming


def test_the_checker_accepts_the_ring_and_explains_mistakes(capsys):
    ok = dp.check_ring_all_reduce(dp.ring_all_reduce)
    assert ok.ok and "Correct" in ok.message and "96 bytes" in ok.message
    bad = dp.check_ring_all_reduce(wrong_sum)
    assert not bad.ok and bad.problem == "wrong sum"
    assert "expected [1000" in bad.message and "got      [400" in bad.message
    stuck = dp.check_ring_all_reduce(recv_first, timeout_s=4)
    assert not stuck.ok and stuck.problem == "deadlock"
    assert "recv" in stuck.message and "async_op=True" in stuck.message
    assert "Deadlock" in capsys.readouterr().out   # the verdicts are printed for the learner


def test_inference_one_batch_per_replica():
    cfg = reference.RunConfig()
    model = reference.build_model(cfg).eval()
    batches = [reference.batch(model, cfg, i)[0] for i in range(3)]
    results = labkit.launch(dp.infer, 2, cfg, batches)
    outputs = {i: out for r in results for i, out in r["outputs"].items()}
    assert sorted(outputs) == [0, 1, 2] and sorted(results[1]["outputs"]) == [1]
    with torch.no_grad():
        for i, x in enumerate(batches):
            assert torch.allclose(outputs[i], model(x), atol=1e-6)
    # rank 0 ran two batches one after the other, rank 1 one: the second replica idles half
    assert results[0]["finished_s"] == pytest.approx(2 * results[1]["finished_s"])
    # the article's Stable Diffusion example: 2.6 s per batch on one node
    one = dp.inference_throughput(2.6, replicas=1, batches=2)
    two = dp.inference_throughput(2.6, replicas=2, batches=2)
    assert two["seconds_per_batch"] == pytest.approx(1.3) and two["latency_s"] == 2.6
    assert two["throughput_per_s"] == pytest.approx(2 * one["throughput_per_s"])
    lone = dp.inference_throughput(2.6, replicas=2, batches=1)   # one batch: no gain at all
    assert lone["makespan_s"] == pytest.approx(2.6) and lone["utilisation"] == 0.5


def test_cli_prints_the_json_report():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "labkit", "run", "dp", "--world-size", "2",
                          "--steps", "2", "--json"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    keys = {"technique", "world_size", "backend", "config", "steps", "loss", "reference_loss",
            "max_param_diff_vs_reference", "memory", "predicted_memory", "comm",
            "predicted_comm_bytes_per_rank", "wall_s", "modelled_step_s"}
    assert keys <= set(report)
    assert report["technique"] == "dp" and report["world_size"] == 2
    assert report["config"]["mode"] == "bucketed" and report["config"]["overlap"] is True
    assert report["loss"] == pytest.approx(report["reference_loss"], abs=1e-5)
    row = next(r for r in report["comm"] if r["op"] == "all_reduce")
    assert row["wire_bytes_per_rank"] == pytest.approx(report["predicted_comm_bytes_per_rank"])
    assert set(report["memory"]) == {"0", "1"}
    assert report["memory"]["0"]["params"] == report["predicted_memory"]["params"]
    # each rank saves activations for its own half of the batch (theory/ within a few percent)
    assert report["memory"]["0"]["activations"] == pytest.approx(
        report["predicted_memory"]["activations"], rel=0.05)
