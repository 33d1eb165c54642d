"""Every input of the serving and profile surfaces is checked before work starts (issue 42):
hypothesis feeds the validators hostile values (NaN, inf, negative, huge, wrong types, empty,
malformed files) and each answer is a valid value or ONE line naming the file, row or flag;
never another exception, a hang or a silent truncation. Files labkit writes are whole or
absent; the store cleanup removes only what a gone launch provably made. The validators are
called directly (fast); a few subprocesses check the exit code and that no traceback shows.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from labkit.cli import main
from labkit.cli_plan import check_fix
from labkit.runs import stream_inputs
from labkit.runtime import atomic, processes
from labkit.theory import profile, stream_sim

SETTINGS = dict(derandomize=True, deadline=None, database=None, max_examples=60,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
HOSTILE = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                         st.integers(),
                                                                         max_size=2))


def one_line(call, kind=ValueError, words=()):
    """call() raises `kind` with a one-line message holding each of `words`; the message."""
    with pytest.raises(kind) as error:
        call()
    message = str(error.value)
    assert message and "\n" not in message, message
    for w in words:
        assert w in message, message
    return message


# ------------------------------------------------------------------ trace rows and trace files

@settings(**SETTINGS)
@given(prompt=HOSTILE, output=HOSTILE, arrival=HOSTILE)
def test_a_trace_row_is_whole_positive_lengths_and_a_finite_arrival_or_one_line(
        prompt, output, arrival):
    row = dict(arrival_s=arrival, prompt=prompt, output=output)
    try:
        got = stream_inputs.check_row(row, "--trace t.json: item 3")
    except ValueError as error:
        message = str(error)
        assert message.startswith("--trace t.json: item 3") and "\n" not in message
        assert any(f in message for f in ("prompt", "output", "arrival_s"))
        return
    for name, value in (("prompt", prompt), ("output", output)):   # never truncated
        assert isinstance(got[name], int) and 1 <= got[name] == float(value)
    assert 0 <= got["arrival_s"] < math.inf and got["arrival_s"] == float(arrival)


@pytest.mark.parametrize("name, content, words", [
    ("nums.json", "[1, 2, 3]", "item 0 must be an object"),
    ("ragged.csv", "arrival_s,prompt,output\n0,8,4\n0.1,8\n", "line 3 has 2 field(s)"),
    ("empty.json", "[]", "holds no request"),
    ("header.csv", "", "holds no request"),
    ("cols.csv", "arrival,prompt,output\n0,8,4\n", "the header must name"),
    ("zero.json", '[{"arrival_s": 0, "prompt": 0, "output": 4}]', "item 0: prompt"),
    ("neg.csv", "arrival_s,prompt,output\n0,-8,4\n", "line 2: prompt"),
    ("frac.csv", "arrival_s,prompt,output\n0,8.5,4\n", "line 2: prompt"),
    ("inf.json", '[{"arrival_s": "inf", "prompt": 8, "output": 4}]', "arrival_s must be"),
    ("nan.csv", "arrival_s,prompt,output\nnan,8,4\n", "line 2: arrival_s"),
    ("before.json", '[{"arrival_s": -5, "prompt": 8, "output": 4}]', "arrival_s must be"),
    ("deep.json", "[" * 100_000, "nested too deeply"),
    ("latin1.csv", b"arrival_s,prompt,output\n0,8,4 \xe9\n", "not UTF-8"),
    ("object.json", '{"arrival_s": 0}', "a list of objects"),
])
def test_a_malformed_trace_is_one_line_naming_the_file_and_row(tmp_path, name, content, words):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    one_line(lambda: stream_inputs.read_trace(str(path)), words=(f"--trace {path}", words))


def test_a_missing_trace_a_folder_and_a_fifo_are_one_line_without_blocking(tmp_path):
    one_line(lambda: stream_inputs.read_trace(str(tmp_path / "no.csv")), words=("cannot read",))
    one_line(lambda: stream_inputs.read_trace(str(tmp_path)), words=("cannot read",))
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    start = time.monotonic()
    one_line(lambda: stream_inputs.read_trace(str(fifo)), words=("not a regular file",))
    assert time.monotonic() - start < 5


@settings(**SETTINGS)
@given(text=st.text(alphabet=st.sampled_from(list(",\n0123456789.-e\"[]{}:naif _")),
                     max_size=80))
def test_any_text_as_a_trace_is_a_stream_or_one_line(text):
    with tempfile.TemporaryDirectory() as folder:
        for suffix, head in ((".csv", "arrival_s,prompt,output\n"), (".json", "")):
            path = os.path.join(folder, "t" + suffix)
            with open(path, "w", encoding="utf-8") as f:
                f.write(head + text)
            try:
                rows = stream_inputs.read_trace(path)
            except ValueError as error:
                assert "\n" not in str(error) and path in str(error)
                continue
            assert rows and [r["id"] for r in rows] == list(range(len(rows)))
            assert all(r["prompt"] >= 1 and r["output"] >= 1 and 0 <= r["arrival_s"] < math.inf
                       for r in rows)
            assert [r["arrival_s"] for r in rows] == sorted(r["arrival_s"] for r in rows)


def test_arrivals_the_wall_clock_would_wait_for_are_refused_unless_modelled():
    late = [dict(id=0, prompt=8, output=4, arrival_s=1e9)]
    one_line(lambda: stream_inputs.check_arrivals(late, False, "--trace t.csv"),
             words=("--trace t.csv", "1e+09 s", "--time-model"))
    stream_inputs.check_arrivals(late, True, "--trace t.csv")      # a modelled clock: fine


@settings(**SETTINGS)
@given(ttft=HOSTILE, tpot=HOSTILE, rate=HOSTILE)
def test_goodput_limits_and_the_rate_are_positive_finite_numbers_or_one_line(ttft, tpot, rate):
    try:
        stream_inputs.check_limits(ttft, tpot, rate)
    except ValueError as error:
        assert "\n" not in str(error) and str(error).startswith(("--ttft-ms", "--tpot-ms",
                                                                 "--rate"))
        return
    for value in (ttft, tpot, rate):
        assert value is None or (not isinstance(value, bool) and 0 < value < math.inf)


def serve_args(**given):
    """run serve's parsed arguments (defaults) with `given` set, and the explicit names."""
    args = argparse.Namespace(requests=None, trace=None, paged=False, time_model=None,
                              prefill_ranks=None, rate=50.0, block_size=8)
    for name, value in given.items():
        setattr(args, name, value)
    return args, set(given)


@pytest.mark.parametrize("given, words", [
    (dict(trace="t.csv", requests=100), "drop --requests"),
    (dict(paged=True), "--paged shapes a request stream"),
    (dict(block_size=4), "--block-size shapes a request stream"),
    (dict(requests=4, block_size=4), "--block-size sets the blocks of a paged KV cache"),
    (dict(trace="t.csv", rate=5.0), "--rate shapes the Poisson stream"),
    (dict(requests=4, batch=3), "--batch applies to `run serve`'s fixed batch"),
    (dict(requests=4, time_gpu="H200"), "give --time-model too"),
])
def test_an_option_that_does_not_apply_is_refused(given, words):
    args, explicit = serve_args(**given)
    one_line(lambda: stream_inputs.check_options(args, explicit), words=(words,))


def test_the_options_of_a_stream_are_accepted_with_one():
    assert stream_inputs.check_options(*serve_args(trace="t.csv", paged=True, block_size=4))
    assert stream_inputs.check_options(*serve_args(requests=4, rate=9.0))
    assert not stream_inputs.check_options(*serve_args())
    # disaggregated prefill sends its KV in blocks of --block-size without a paged cache
    assert stream_inputs.check_options(*serve_args(requests=4, prefill_ranks=1, block_size=4))


@settings(**SETTINGS)
@given(low=HOSTILE, high=HOSTILE)
def test_poisson_length_ranges_are_whole_tokens_low_to_high_or_one_line(low, high):
    try:
        stream_inputs.check_ranges((low, high), (4, 16))
    except ValueError as error:
        assert str(error).startswith("--stream-prompt-len") and "\n" not in str(error)
        return
    assert isinstance(low, int) and 1 <= low <= high <= stream_inputs.MAX_LENGTH


def test_a_stream_that_cannot_fit_here_is_refused_before_any_rank():
    from labkit.runs import stream
    cfg = stream.StreamConfig(requests=2, rate=100.0)
    rows = cfg.stream()
    gpt = cfg.gpt_config(rows)
    stream.check_fits(cfg, gpt, rows, available=1 << 40)
    one_line(lambda: stream.check_fits(cfg, gpt, rows, available=1 << 20),
             words=("the stream needs about", "KV pool"))


# ------------------------------------------------------------- plan --serve --rate and simulate

@settings(**SETTINGS)
@given(rate=HOSTILE, requests=HOSTILE, ttft=HOSTILE)
def test_plan_stream_inputs_are_checked_before_any_simulation(rate, requests, ttft):
    try:
        stream_sim.check_plan_inputs(rate, requests, ttft, None)
    except ValueError as error:
        assert "\n" not in str(error)
        return
    assert 1 <= requests <= stream_sim.MAX_REQUESTS
    assert requests / rate <= stream_sim.MAX_STREAM_S and math.isfinite(requests / rate)


@settings(**SETTINGS)
@given(lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40),
                                  st.floats(0, 5)), min_size=1, max_size=6),
       blocks=st.integers(1, 6), policy=st.sampled_from(["static", "continuous"]))
def test_simulate_finishes_every_request_or_refuses_one_larger_than_the_pool(
        lengths, blocks, policy):
    stream = [dict(id=i, prompt=p, output=o, arrival_s=a) for i, (p, o, a) in enumerate(lengths)]
    pool = blocks * 8
    if max(p + o for p, o, _ in lengths) > pool:
        one_line(lambda: stream_sim.simulate(stream, lambda pieces: 1e-3, policy, 4,
                                             num_blocks=blocks, block_size=8),
                 words=("exceed the whole KV pool",))
        return
    done = stream_sim.simulate(stream, lambda pieces: 1e-3, policy, 4, num_blocks=blocks,
                               block_size=8)
    assert [len(r.token_times) for r in done] == [o for _, o, _ in lengths]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_simulate_refuses_an_arrival_that_never_comes(bad):
    one_line(lambda: stream_sim.simulate([dict(id=0, prompt=4, output=2, arrival_s=bad)],
                                         lambda pieces: 1e-3), words=("arrival_s",))


def test_plan_stream_refuses_a_request_larger_than_the_modelled_kv_pool_quickly():
    start = time.monotonic()
    one_line(lambda: stream_sim.plan_stream("llama-3-8b", 1, rate=10.0, requests=2,
                                            prompt_len=1_000_000),
             words=("--prompt-len 1000000", "exceeds the KV pool"))
    assert time.monotonic() - start < 5


@settings(**SETTINGS)
@given(text=st.lists(st.sampled_from(["tp=8", "tp=4", "pp=2", "ep=1", "replicas=2", "dp=4"]),
                     max_size=5))
def test_fix_gives_each_field_once(text):
    keys = [t.split("=")[0] for t in text]
    if len(set(keys)) < len(keys):
        one_line(lambda: check_fix(",".join(text)), words=("is given twice",))
    else:
        check_fix(",".join(text))


# -------------------------------------------------------------------------- --gpu-profile

def good_profile():
    with open(os.path.join(os.path.dirname(__file__), "..", "data", "profiles", "h200.json"),
              encoding="utf-8") as f:
        return json.load(f)


@settings(**SETTINGS)
@given(field=st.sampled_from(["hbm_gbps", "tflops", "seconds", "m"]), value=HOSTILE)
def test_a_profile_number_outside_what_a_gpu_measures_is_one_line(field, value):
    data = good_profile()
    if field == "hbm_gbps":
        data["hbm_gbps"] = value
    elif field == "seconds":
        data["decode_step_s"][0]["seconds"] = value
    else:
        data["gemm"][0][field] = value
    try:
        checked = profile.check_profile(data, where="--gpu-profile p.json")
    except ValueError as error:
        assert str(error).startswith("--gpu-profile p.json") and "\n" not in str(error)
        return
    low, high, _ = profile.BOUNDS.get(field, (1, profile.MAX_INT, ""))
    assert not isinstance(value, bool) and low <= value <= high and checked is data


@settings(**SETTINGS)
@given(text=st.text(max_size=30))
def test_printable_leaves_no_control_character_to_a_terminal(text):
    shown = profile.printable(text)
    assert not any(c in shown for c in "\n\r\x1b\x07\x00\u202e\u2028")
    assert shown == text or "\\" in shown


@pytest.mark.parametrize("content, words", [
    ("[" * 100_000, "nested too deeply"),
    (b"\xff\xfe{", "not UTF-8 text"),
    ("x" * (profile.MAX_BYTES + 1), "larger than"),
])
def test_a_profile_file_that_is_not_one_is_one_line(tmp_path, content, words):
    path = tmp_path / "p.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    one_line(lambda: profile.load_profile(str(path)), words=(str(path), words))


def test_a_fifo_profile_does_not_block_and_a_forged_gpu_name_is_escaped(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    one_line(lambda: profile.load_profile(str(fifo)), words=("not a regular file",))
    data = dict(good_profile(), gpu="H200\n\x1b[2Jready: all checks passed")
    path = tmp_path / "forged.json"
    path.write_text(json.dumps(data))
    gpu, header = profile.plan_gpu(str(path), "H200")
    assert "\n" not in header and "\x1b" not in header and "\\n\\x1b[2J" in header
    assert "\x1b" not in gpu.name


# ---------------------------------------------------------------------------- atomic writes

def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "rows.json"
    atomic.write_json(path, dict(old=True))
    with pytest.raises(TypeError):                      # not serialisable: nothing written
        atomic.write_json(path, dict(bad=object()))

    def full_disk(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        atomic.write_json(path, dict(new=True))
    assert json.loads(path.read_text()) == dict(old=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]


def test_an_atomic_write_keeps_the_mode_follows_a_link_and_writes_devices_in_place(tmp_path):
    target = tmp_path / "real.md"
    atomic.write_text(target, "one")
    os.chmod(target, 0o640)
    link = tmp_path / "link.md"
    link.symlink_to(target)
    atomic.write_text(link, "two")
    assert link.is_symlink() and target.read_text() == "two"
    assert os.stat(target).st_mode & 0o777 == 0o640
    atomic.write_text(os.devnull, "discarded")          # a device is not renamed over
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)
    if os.path.exists("/dev/full"):
        with pytest.raises(OSError):
            atomic.write_text("/dev/full", "x")


# --------------------------------------------------------------------------- store cleanup

def test_the_store_cleanup_removes_only_what_a_gone_launch_provably_made(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / "labkit-store-1-a"
    dead.mkdir()
    processes.mark_store_folder(str(dead), pid=gone.pid)
    assert processes.made_by_a_gone_launch(str(dead))
    mine = tmp_path / "labkit-store-2-b"
    mine.mkdir()
    processes.mark_store_folder(str(mine))              # this process: alive
    unmarked = tmp_path / "labkit-store-3-c"
    unmarked.mkdir()
    elsewhere = tmp_path / "labkit-store-4-d"          # another container's: another boot id
    elsewhere.mkdir()
    (elsewhere / processes.OWNER_FILE).write_text(json.dumps(
        dict(processes.process_identity(gone.pid), boot_id="another-machine")))
    link = tmp_path / "labkit-store-5-e"
    link.symlink_to(dead)
    for folder in (mine, unmarked, elsewhere, link):
        assert not processes.made_by_a_gone_launch(str(folder)), folder


# -------------------------------------------------------------------------------- libraries

@settings(**SETTINGS)
@given(tokens=HOSTILE)
def test_reserve_takes_a_positive_integer_or_refuses(tokens):
    from labkit.parallel.paged_kv import PagedKVCache
    cache = PagedKVCache(1, 4, 4, 4)
    try:
        cache.reserve(0, tokens)
    except ValueError as error:
        assert "tokens" in str(error) and "\n" not in str(error)
        assert isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1
        return
    assert isinstance(tokens, int) and tokens >= 1


@settings(**SETTINGS)
@given(output=HOSTILE, prompt_len=st.integers(0, 3), arrival=HOSTILE)
def test_engine_requests_are_checked_before_any_step(output, prompt_len, arrival):
    from labkit.parallel.batching import Request, check_requests
    request = Request(7, torch.arange(prompt_len), output, arrival)
    try:
        check_requests([request])
    except ValueError as error:
        assert str(error).startswith("request 7") and "\n" not in str(error)
        return
    assert isinstance(output, int) and output >= 1 and prompt_len >= 1 and 0 <= arrival < math.inf


def test_library_mistakes_name_their_argument():
    from labkit import models
    from labkit.parallel.batching import Engine, Request
    from labkit.parallel.paged_kv import PagedKVCache
    from labkit.parallel.serving import generate
    from labkit.runs import reference
    from labkit.runs.trainer import Trainer
    gpt = models.build("gpt", seed=0, layers=1, hidden=16, heads=2, ffn=32, seq=16,
                       vocab=32).eval()
    prompt = torch.arange(4)
    engine = Engine(gpt, PagedKVCache(1, 16, 8, 4))
    one_line(lambda: engine.run([Request(0, prompt, 2), Request(0, prompt, 2)]),
             words=("request id 0 is given twice",))
    one_line(lambda: generate(gpt, prompt[None], 20), words=("new_tokens 20", "16"))
    one_line(lambda: generate(gpt, prompt[None, :0], 2), words=("prompt",))
    import labkit
    one_line(lambda: labkit.HybridParallel(gpt, None, None), TypeError, ("mesh", "None"))
    cfg = reference.RunConfig(steps=1, global_batch=8, model="mlp")
    mlp = models.build("mlp", seed=0)

    def batch(step):
        return reference.batch(mlp, cfg, step)
    one_line(lambda: Trainer(None, cfg, mlp, optimizer=None, batch=batch), TypeError,
             ("optimizer",))
    one_line(lambda: Trainer(None, cfg, mlp, optimizer=reference.build_optimizer,
                             batch=lambda step: None).fit(), TypeError, ("batch(step)",))
    one_line(lambda: Trainer(None, cfg, mlp, optimizer=reference.build_optimizer, batch=batch,
                             accumulate=3).fit(), words=("accumulate=3", "8 rows"))


def test_launch_checks_fn_before_any_process_starts():
    import multiprocessing
    import labkit
    before = multiprocessing.active_children()
    start = time.monotonic()
    one_line(lambda: labkit.launch(42, 2), TypeError, ("fn must be a function",))
    assert time.monotonic() - start < 0.5 and multiprocessing.active_children() == before


# ----------------------------------------------------------- the CLI: exit codes, no traceback

@pytest.mark.parametrize("argv, words", [
    (["plan", "--model", "llama-3-8b", "--gpus", "8", "--global-batch", "64", "--fix",
      "tp=8,tp=4"], "tp is given twice"),
    (["plan", "--serve", "--model", "llama-3-70b", "--gpus", "1000000000"], "nearly every GPU"),
    (["plan", "--serve", "--model", "llama-3-8b", "--gpus", "1", "--rate", "1e-320"],
     "more than a year"),
    (["plan", "--serve", "--model", "llama-3-8b", "--gpus", "1", "--rate", "10", "--ttft-ms",
      "-1"], "--ttft-ms must be"),
    (["plan", "--serve", "--model", "llama-3-8b", "--gpus", "1", "--rate", "10", "--requests",
      "2000000"], "--requests must be"),
    (["gpu-check", "--budget-s", "0"], "--budget-s must be"),
    (["run", "serve", "--requests", "12", "--world-size", "2"], "--world-size 2"),
    (["run", "serve", "--requests", "4", "--rate", "1e-6"], "arrives at"),
])
def test_cli_mistakes_are_one_line_and_exit_2(argv, words, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and words in err and err.count("\n") == 1, err


def test_gpu_check_out_dir_on_a_file_is_one_line(tmp_path, capsys):
    afile = tmp_path / "a.txt"
    afile.write_text("")
    assert main(["gpu-check", "--out-dir", str(afile)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv, content", [
    (["run", "serve", "--trace", "{path}"], "[1, 2, 3]"),
    (["plan", "--serve", "--model", "llama-3-8b", "--gpus", "1", "--rate", "10",
      "--prompt-len", "1000000"], None),
])
def test_cli_refusals_show_no_traceback(tmp_path, argv, content):
    path = tmp_path / "nums.json"
    if content:
        path.write_text(content)
    out = subprocess.run([sys.executable, "-m", "labkit", *[a.format(path=path) for a in argv]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr


def test_plan_serve_to_a_full_disk_is_one_line_and_exit_1():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "labkit", "plan", "--serve", "--model",
                              "llama-3-8b", "--gpus", "8"], stdout=full, stderr=subprocess.PIPE,
                             text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: the report could not be written to stdout")
