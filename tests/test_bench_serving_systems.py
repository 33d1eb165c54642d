"""bench/serving_systems.py's stream: the settings it compares measure what they claim, and a
run whose tokens differ from each request served alone stops the bench."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import serving_systems as bench  # noqa: E402


@pytest.fixture(scope="module")
def small():
    """The bench's stream shrunk: 8 requests (one prompt of 512 tokens), 4 x 544 KV slots."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in dict(STREAM_N=8, RATE=200.0, LONG=512, SEQ=544).items():
            patch.setattr(bench, name, value)
        yield bench.stream_setup()


def test_paged_runs_more_requests_than_contiguous_in_the_same_bytes(small):
    runs = {k: bench.serve_stream(*small, k) for k in ("continuous", "contiguous")}
    assert runs["continuous"]["pool_bytes"] == runs["contiguous"]["pool_bytes"]
    assert runs["contiguous"]["peak_running"] <= bench.POOL_SEQS
    assert runs["continuous"]["peak_running"] > runs["contiguous"]["peak_running"]
    assert runs["continuous"]["wasted_bytes"] < runs["contiguous"]["wasted_bytes"]


def test_chunked_prefill_cuts_the_modelled_stall_and_keeps_the_tokens(small):
    from functools import partial
    h100 = partial(bench.theory.modelled_step_s, bench.catalog.model("llama-3-8b"),
                   bench.hardware.gpu("H100"))
    model, stream, prompts, alone = small
    assert any(r["prompt"] == bench.LONG for r in stream)
    whole = bench.serve_stream(model, stream, prompts, alone, "continuous", step_time=h100)
    chunked = bench.serve_stream(model, stream, prompts, alone, "chunked", step_time=h100)
    # a 512-token prefill is compute-bound on an H100 (~14 ms with its launches), 128-token
    # chunks are not: their step is the weights' read plus the launches (~9 ms)
    assert chunked["p99_tbt_s"] < 0.7 * whole["p99_tbt_s"]


def test_a_run_whose_tokens_differ_stops_the_bench(small):
    model, stream, prompts, alone = small
    wrong = {**alone, 0: [t + 1 for t in alone[0]]}
    with pytest.raises(SystemExit, match="differ from it served alone"):
        bench.serve_stream(model, stream, prompts, wrong, "static")
