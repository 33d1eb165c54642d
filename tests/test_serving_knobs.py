"""vLLM's remaining serving knobs (issue 41): the KV pool from gpu_memory_utilization (or
num_gpu_blocks_override), preemption in vLLM's order under the fcfs and priority scheduling
policies, prefix caching in the token-free simulator, and the flag names of `run serve` and
`plan --serve --rate`."""
import json
import subprocess
import sys

import pytest
import torch

from labkit import cli, models
from labkit.parallel.batching import Engine, Request
from labkit.parallel.paged_kv import PagedKVCache
from labkit.parallel.serving import generate
from labkit.theory import catalog, hardware, serving as model_serving, stream_sim

TINY = models.build("gpt", seed=0, seq=48, layers=1, hidden=16, heads=2, ffn=32,
                    vocab=32).eval()


def _times(done):
    return [t for r in done for t in r.token_times]


def _priced(pieces):
    return 1e-3 + sum(1e-5 * new + 1e-7 * cached for new, cached in pieces)


# ------------------------------------------------------------------------------ preemption

# five requests at once into 12 blocks of 4: too few, so some are preempted (and recomputed)
ROWS = [dict(id=i, prompt=p, output=o, arrival_s=0.001 * i, priority=pr)
        for i, (p, o, pr) in enumerate([(6, 12, 2), (7, 12, 0), (5, 12, 3), (6, 12, 1),
                                        (4, 10, 0)])]


def _serve(policy):
    g = torch.Generator().manual_seed(0)
    ids = {r["id"]: torch.randint(0, 32, (r["prompt"],), generator=g) for r in ROWS}
    engine = Engine(TINY, PagedKVCache(1, 16, 12, 4), "continuous", 4, step_time=_priced,
                    scheduling_policy=policy)
    done = engine.run([Request(r["id"], ids[r["id"]], r["output"], r["arrival_s"],
                               priority=r["priority"]) for r in ROWS])
    return engine, done, ids


def test_preemption_order_follows_the_policy_and_tokens_equal_each_alone():
    """fcfs preempts the request admitted last (vLLM v1's running.pop()), priority the running
    request of the largest (priority, arrival); the victims differ, every request's tokens
    still equal it served alone, and the simulator preempts the same requests."""
    order = {}
    for policy in ("fcfs", "priority"):
        engine, done, ids = _serve(policy)
        order[policy] = engine.preempted
        assert engine.preempted, policy
        for r in done:
            assert r.generated == generate(TINY, ids[r.id][None], r.output)[0].tolist()
        sim = stream_sim.simulate(ROWS, _priced, "continuous", 4, None, 12, 4,
                                  scheduling_policy=policy)
        assert [r.preemptions for r in sim] == [r.preemptions for r in done]
        assert _times(sim) == pytest.approx(_times(done), rel=1e-12)
    assert order["fcfs"] != order["priority"]
    # by hand: 4 admitted (max_num_seqs) in arrival order 0..3; fcfs takes the last admitted
    # (3), priority the largest priority value among the running (request 2, priority 3)
    assert order["fcfs"][0] == 3 and order["priority"][0] == 2
    # the priority policy never preempts a request while one of lower priority runs
    _, done, _ = _serve("priority")
    assert done[1].preemptions == 0 and done[4].preemptions == 0     # priority 0


def test_priority_admits_the_lowest_value_first():
    rows = [dict(id=i, prompt=5, output=3, arrival_s=0.0, priority=p)
            for i, p in enumerate([5, 1, 3, 0])]
    reqs = [Request(r["id"], torch.arange(5) + r["id"], 3, 0.0, priority=r["priority"])
            for r in rows]
    done = Engine(TINY, PagedKVCache(1, 16, 40, 4), "continuous", 1, step_time=_priced,
                  scheduling_policy="priority").run(reqs)
    first = sorted(done, key=lambda r: r.token_times[0])
    assert [r.id for r in first] == [3, 1, 2, 0]
    sim = stream_sim.simulate(rows, _priced, "continuous", 1, scheduling_policy="priority")
    assert _times(sim) == pytest.approx(_times(done))
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        Engine(TINY, PagedKVCache(1, 16, 4, 4), scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority must be an integer"):
        Engine(TINY, PagedKVCache(1, 16, 40, 4)).run([Request(0, torch.arange(3), 2,
                                                              priority=0.5)])


# ------------------------------------------------------------------------------ prefix caching

@pytest.mark.parametrize("n,prefix,block", [(5, 19, 4), (4, 16, 8), (6, 7, 4)])
def test_simulated_prefix_cache_hits_the_formula_and_the_engine(n, prefix, block):
    """n requests sharing a P-token system prompt, each arriving after the one before is
    prefilled: (n - 1) x floor(P / B) full blocks hit, of the prompt tokens looked up; the
    simulator counts what the engine's PagedKVCache counts, step times included."""
    rows = [dict(id=i, prompt=prefix + 5 + i, output=3, arrival_s=1.0 * i) for i in range(n)]
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, 32, (prefix,), generator=g)
    reqs = []
    for r in rows:
        ids = torch.randint(0, 32, (r["prompt"],), generator=g)
        ids[:prefix], ids[prefix] = system, r["id"]    # the first own token: distinct
        reqs.append(Request(r["id"], ids, r["output"], r["arrival_s"]))
    cache = PagedKVCache(1, 16, 100, block, enable_prefix_caching=True)
    done = Engine(TINY, cache, "continuous", 4, step_time=_priced).run(reqs)
    pool = stream_sim.BlockPool(100, block, enable_prefix_caching=True)
    sim = stream_sim.simulate(rows, _priced, "continuous", 4, None, 100, block,
                              shared_prefix=prefix, cache=pool)
    hits = (n - 1) * (prefix // block) * block
    queries = sum(r["prompt"] for r in rows)
    got = pool.prefix_stats()
    assert (got["hits"], got["queries"]) == (hits, queries)
    assert got["hit_rate"] == pytest.approx(hits / queries) and got["prefill_tokens_saved"] == hits
    assert got == cache.prefix_stats()
    assert _times(sim) == pytest.approx(_times(done), rel=1e-12)
    # the hits are prefill not done: the second request's first token comes sooner
    alone = stream_sim.simulate(rows, _priced, "continuous", 4, None, 100, block)
    if prefix >= block:
        assert sim[1].token_times[0] - 1.0 < alone[1].token_times[0] - 1.0


def test_simulated_prefix_cache_evicts_as_the_engine_does():
    """A pool too small to keep every cached block: evictions and hits still agree."""
    rows = [dict(id=i, prompt=14 + i % 3, output=4, arrival_s=0.004 * i) for i in range(8)]
    reqs = [Request(r["id"], torch.cat([torch.arange(12) % 32, torch.full((r["prompt"] - 12,),
                                                                          r["id"])]),
                    r["output"], r["arrival_s"]) for r in rows]
    cache = PagedKVCache(1, 16, 14, 4, enable_prefix_caching=True)
    done = Engine(TINY, cache, "continuous", 3, step_time=_priced).run(reqs)
    pool = stream_sim.BlockPool(14, 4, enable_prefix_caching=True)
    sim = stream_sim.simulate(rows, _priced, "continuous", 3, None, 14, 4, shared_prefix=12,
                              cache=pool)
    assert pool.prefix_stats() == cache.prefix_stats()
    assert cache.evictions > 0 and cache.hits > 0
    assert [r.preemptions for r in sim] == [r.preemptions for r in done]


# ------------------------------------------------------------------------------ the KV pool

def test_kv_pool_from_gpu_memory_utilization_by_hand():
    m, g = catalog.model("llama-3-8b"), hardware.gpu("H100")
    pool = stream_sim.kv_pool("llama-3-8b", "H100", gpu_memory_utilization=0.9,
                              profile_tokens=2048, max_num_seqs=64)
    act = 2048 * (4 * m.hidden + 3 * m.ffn) * 2 + 64 * m.vocab * 4
    per_block = 16 * model_serving.kv_bytes_per_token(m)
    assert pool["activation_bytes"] == act
    assert pool["num_blocks"] == int((0.9 * g.memory_bytes - 2 * m.param_count() - act)
                                     // per_block)
    # a larger fraction holds more blocks; the override gives the count
    assert stream_sim.kv_pool("llama-3-8b", "H100", gpu_memory_utilization=0.95,
                              profile_tokens=2048, max_num_seqs=64)["num_blocks"] > \
        pool["num_blocks"]
    assert stream_sim.kv_pool("llama-3-8b", num_gpu_blocks_override=100)["num_blocks"] == 100
    for kw, says in ((dict(gpu_memory_utilization=0.1), "do not fit --gpu-memory-utilization"),
                     (dict(gpu_memory_utilization=1.5), r"a fraction in \(0, 1\]"),
                     (dict(num_gpu_blocks_override=0), "positive number of blocks")):
        with pytest.raises(ValueError, match=says) as error:
            stream_sim.kv_pool("llama-3-8b", "H100", **kw)
        assert "\n" not in str(error.value)
    out = stream_sim.plan_stream("llama-3-8b", 1, rate=5, requests=8,
                                 num_gpu_blocks_override=120)
    assert out["kv_pool"]["num_blocks"] == 120 and out["cluster"]["kv_token_slots"] == 120 * 16


# ------------------------------------------------------------------------------ flag names

def _stream_args(*flags):
    """run serve's parsed stream config (argparse, then runs/stream.config_from_args)."""
    from labkit.runs import stream
    captured = {}
    real = stream.report
    stream.report = lambda cfg: captured.setdefault("cfg", cfg) and {}
    try:
        cli.main(["run", "serve", "--requests", "4", *flags])
    except Exception:       # noqa: BLE001 - the formatting of the empty report
        pass
    finally:
        stream.report = real
    return captured["cfg"]


def test_run_serve_takes_vllms_flag_names():
    cfg = _stream_args("--paged", "--max-num-seqs", "3", "--max-num-batched-tokens", "12",
                       "--enable-prefix-caching", "--scheduling-policy", "priority",
                       "--num-gpu-blocks-override", "40", "--temperature", "0.7",
                       "--top-p", "0.9", "--seed", "3", "--shared-prefix", "8")
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_prefix_caching,
            cfg.scheduling_policy, cfg.num_gpu_blocks_override, cfg.temperature, cfg.top_p,
            cfg.seed, cfg.shared_prefix) == (3, 12, True, "priority", 40, 0.7, 0.9, 3, 8)
    old = _stream_args("--max-batch", "3", "--chunk", "12", "--no-enable-prefix-caching")
    assert (old.max_num_seqs, old.max_num_batched_tokens, old.enable_prefix_caching) == \
        (3, 12, False)
    cfg = _stream_args("--gpu-memory-utilization", "0.5", "--time-model", "llama-3-8b")
    assert cfg.gpu_memory_utilization == 0.5


@pytest.mark.parametrize("args,says", [
    (["--gpu-memory-utilization", "0.9"], "--time-model"),
    (["--num-gpu-blocks-override", "4", "--kv-tokens", "64"], "drop --kv-tokens"),
    (["--scheduling-policy", "lifo"], "invalid choice"),
    (["--temperature", "-1"], "temperature must be"),
    (["--top-p", "0"], "top_p must be"),
    (["--paged", "--num-gpu-blocks-override", "1"], "larger than the whole KV cache")])
def test_run_serve_refuses_the_new_flags_in_one_line(capsys, args, says):
    with pytest.raises(SystemExit) if says == "invalid choice" else _nothing():
        assert cli.main(["run", "serve", "--requests", "4", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and (says == "invalid choice" or err.count("\n") == 1)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_plan_serve_rate_takes_vllms_flag_names_and_refuses_without_rate(capsys):
    from labkit.cli_plan import serve_plan_main
    base = ["--serve", "--model", "llama-3-8b", "--gpus", "1"]
    assert serve_plan_main(base + ["--rate", "5", "--requests", "12", "--max-num-seqs", "8",
                                   "--max-num-batched-tokens", "256",
                                   "--gpu-memory-utilization", "0.8",
                                   "--enable-prefix-caching", "--shared-prefix", "256",
                                   "--scheduling-policy", "priority", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    w = out["workload"]
    assert (w["max_num_seqs"], w["max_num_batched_tokens"], w["scheduling_policy"],
            w["enable_prefix_caching"], w["shared_prefix"]) == (8, 256, "priority", True, 256)
    assert out["kv_pool"]["gpu_memory_utilization"] == 0.8
    assert all(p["prefix_cache"]["hit_rate"] > 0 for p in out["policies"])
    assert serve_plan_main(base + ["--max-num-seqs", "8"]) == 2
    assert "--rate" in capsys.readouterr().err
    assert serve_plan_main(base + ["--rate", "5", "--gpu-memory-utilization", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "do not fit --gpu-memory-utilization 0.1" in err and err.count("\n") == 1


def test_one_short_run_with_the_new_flags():
    out = subprocess.run(
        [sys.executable, "-m", "labkit", "run", "serve", "--requests", "6", "--layers", "2",
         "--paged", "--block-size", "4", "--enable-prefix-caching", "--shared-prefix", "12",
         "--scheduling-policy", "priority", "--num-gpu-blocks-override", "12",
         "--temperature", "0.8", "--top-p", "0.9", "--seed", "1", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "16", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["tokens_differing"] == 0          # each sampled request as it is served alone
    assert r["kv_pool"] == dict(num_blocks=12, block_size=4, source="num_gpu_blocks_override",
                                allocated_blocks=12)
    assert r["scheduling_policy"] == "priority" and r["prefix_cache"]["hits"] > 0
    assert len(r["preempted"]) == r["preemptions"]
    assert max(s for s in [r["step_tokens_max"]]) <= 16


def test_a_request_no_empty_pool_can_hold_is_refused_not_looped_on():
    """simulate's own check sizes the stream against num_blocks; a cache handed in smaller
    than that must still end in one line, not an endless wait for room."""
    rows = [dict(id=0, prompt=40, output=2, arrival_s=0.0)]
    with pytest.raises(ValueError, match="does not fit the whole KV pool"):
        stream_sim.simulate(rows, _priced, "continuous", 4, None, 100, 4,
                            cache=stream_sim.BlockPool(2, 4))
