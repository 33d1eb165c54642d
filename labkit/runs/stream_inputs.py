"""The inputs of `run serve`'s request streams, checked before any rank starts.

A stream comes from `--requests N --rate R` (Poisson) or from `--trace FILE`, a CSV with the
columns arrival_s, prompt, output (and optionally priority: vLLM's, lower served first under
--scheduling-policy priority) or a JSON list of such objects. Every row is checked here, and
a mistake is one ValueError naming the file, the row and the field: a prompt or output that is
not a positive whole number (0, -8, 8.5 are refused, not truncated), an arrival that is not a
finite number of seconds >= 0 (NaN or inf never comes; -5 would count a wait that never
happened), an empty trace, a ragged CSV row, a file that is missing, not a regular file (a FIFO
would block), too large or not UTF-8. On CPU ranks the engine waits for arrivals in wall time,
so a stream whose last request arrives after `MAX_WALL_ARRIVAL_S` (a rate of 1e-6, an arrival
far in the future) is refused instead of running into the launch's timeout; under
`--time-model` the clock is modelled and waiting costs nothing.

`check_options` holds the one rule of the options: a stream is `--requests N` (Poisson) or
`--trace FILE` (its rows are the requests, so `--requests`, `--rate` and the length ranges do
not apply beside it); the stream's options need a stream, the fixed batch's options
(--batch, --prompt-len, --new-tokens) do not apply to one, `--block-size` needs `--paged`, and
`--world-size` must be the ranks the layout runs on; `add_arguments` declares the options
themselves (vLLM's names). Plain Python: no torch.
"""
import argparse
import csv
import io
import math

from ..theory.stream_sim import SCHEDULING_POLICIES
from ..theory.user_files import parse_user_json, read_user_text

FIELDS = ("arrival_s", "prompt", "output")
MAX_TRACE_BYTES = 16 << 20       # 16 MiB: about 500,000 rows, far beyond what CPU ranks serve
MAX_ROWS = 10_000                # requests a trace may hold (the tiny GPT serves ~100/minute)
MAX_WALL_ARRIVAL_S = 150.0       # half the ranks' 300 s timeout (runs/serve.TIMEOUT_S)
MAX_LENGTH = 1 << 20             # tokens of a prompt or an output: beyond it, a typo

# run serve's option groups (argparse dests); what each mode takes is decided in check_options
STREAM_OPTIONS = ("rate", "policy", "max_batch", "paged", "block_size", "kv_tokens", "chunk",
                  "stream_prompt_len", "stream_output_len", "time_model", "time_gpu",
                  "ttft_ms", "tpot_ms",
                  # vLLM's names of the batch and the step's token budget (issue 41)
                  "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                  "no_enable_chunked_prefill", "enable_prefix_caching",
                  "no_enable_prefix_caching", "shared_prefix", "scheduling_policy",
                  "num_gpu_blocks_override", "gpu_memory_utilization", "temperature", "top_p")
POISSON_OPTIONS = ("rate", "stream_prompt_len", "stream_output_len")
FIXED_BATCH_OPTIONS = ("batch", "prompt_len", "new_tokens", "ep", "top_k")


def read_trace(path):
    """The trace at `path` as [{id, prompt, output, arrival_s}], sorted by arrival and numbered
    in that order; a bad file or row: one-line ValueError (see the module docstring)."""
    where = f"--trace {path}"
    text = read_user_text(path, where, MAX_TRACE_BYTES, "a trace is UTF-8 CSV or JSON")
    if str(path).lower().endswith(".json"):
        rows = _json_rows(text, where)
    else:
        rows = _csv_rows(text, where)
    if not rows:
        raise ValueError(f"{where}: holds no request; give at least one row of "
                         "arrival_s, prompt, output")
    if len(rows) > MAX_ROWS:
        raise ValueError(f"{where}: {len(rows):,} requests, more than the {MAX_ROWS:,} a "
                         "trace may hold here")
    out = [check_row(row, label) for label, row in rows]
    order = sorted(range(len(out)), key=lambda i: out[i]["arrival_s"])
    return [dict(out[i], id=n) for n, i in enumerate(order)]


def _json_rows(text, where):
    """[(label, row)] of a JSON trace: a list of objects."""
    data = parse_user_json(text, where, "a trace")
    if not isinstance(data, list):
        raise ValueError(f"{where}: a JSON trace is a list of objects "
                         f"{{arrival_s, prompt, output}}, got {type(data).__name__}")
    rows = []
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: item {i} must be an object {{arrival_s, prompt, "
                             f"output}}, got {_show(row)}")
        rows.append((f"{where}: item {i}", row))
    return rows


def _csv_rows(text, where):
    """[(label, row)] of a CSV trace: a header naming the fields, one request per line."""
    reader = csv.reader(io.StringIO(text))
    try:
        lines = [(reader.line_num, line) for line in reader if line]
    except csv.Error as error:
        raise ValueError(f"{where}: not CSV ({error})") from None
    if not lines:
        return []
    header = [h.strip() for h in lines[0][1]]
    missing = [f for f in FIELDS if f not in header]
    if missing or len(set(header)) != len(header):
        raise ValueError(f"{where}: the header must name the columns arrival_s, prompt, output "
                         f"once each, got {','.join(header)[:80]!r}")
    rows = []
    for number, line in lines[1:]:
        if len(line) != len(header):
            raise ValueError(f"{where}: line {number} has {len(line)} field(s), the header "
                             f"{len(header)}")
        rows.append((f"{where}: line {number}", dict(zip(header, line))))
    return rows


def check_row(row, label):
    """{prompt, output, arrival_s} of one trace row, each checked (see the module docstring)."""
    for name in FIELDS:
        if name not in row:
            raise ValueError(f"{label} lacks {name}")
    prompt, output = (_length(row[name], f"{label}: {name}") for name in ("prompt", "output"))
    arrival = _number(row["arrival_s"], f"{label}: arrival_s")
    if not 0 <= arrival < math.inf:
        raise ValueError(f"{label}: arrival_s must be a finite number of seconds >= 0 (since "
                         f"the stream starts), got {_show(row['arrival_s'])}")
    out = dict(prompt=prompt, output=output, arrival_s=arrival)
    if row.get("priority") not in (None, ""):       # optional: vLLM's, lower served first
        priority = _number(row["priority"], f"{label}: priority")
        if not (math.isfinite(priority) and priority == int(priority)):
            raise ValueError(f"{label}: priority must be a whole number (lower is served "
                             f"first under --scheduling-policy priority), got "
                             f"{_show(row['priority'])}")
        out["priority"] = int(priority)
    return out


def _number(value, label):
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{label} must be a number, got {_show(value)}")
    try:
        return float(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{label} must be a number, got {_show(value)}") from None


def _length(value, label):
    """A positive whole number of tokens (8, 8.0 or "8"; not 0, -8, 8.5 or "eight")."""
    number = _number(value, label)
    if not (math.isfinite(number) and number == int(number) and 1 <= number <= MAX_LENGTH):
        raise ValueError(f"{label} must be a whole number of tokens from 1 to {MAX_LENGTH:,}, "
                         f"got {_show(value)}")
    return int(number)


def _show(value):
    """A value as a message shows it: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_arrivals(stream, modelled_clock, source):
    """Refuse a stream the ranks would wait for past their timeout (wall clock only)."""
    last = max(r["arrival_s"] for r in stream)
    if not modelled_clock and last > MAX_WALL_ARRIVAL_S:
        raise ValueError(f"{source}: the last request arrives at {last:.3g} s; the ranks wait "
                         f"for arrivals in wall time and stop at 300 s, so keep arrivals under "
                         f"{MAX_WALL_ARRIVAL_S:.0f} s (a larger --rate), or model the clock "
                         "with --time-model")


def check_limits(ttft_ms, tpot_ms, rate=None, requests=None):
    """Goodput's limits and the Poisson rate: positive finite numbers; at most MAX_ROWS
    requests."""
    if requests is not None and not 1 <= requests <= MAX_ROWS:
        raise ValueError(f"--requests must be an integer from 1 to {MAX_ROWS:,}, got "
                         f"{requests}")
    for flag, value in (("--ttft-ms", ttft_ms), ("--tpot-ms", tpot_ms), ("--rate", rate)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise ValueError(f"{flag} must be a positive finite number, got {value!r}")


def check_ranges(prompt_len, output_len):
    """--stream-prompt-len and --stream-output-len: inclusive ranges 1 <= LO <= HI <=
    MAX_LENGTH of whole tokens."""
    for flag, pair in (("--stream-prompt-len", prompt_len), ("--stream-output-len", output_len)):
        low, high = pair
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in pair) or \
                not 1 <= low <= high <= MAX_LENGTH:
            raise ValueError(f"{flag} {_show(low)} {_show(high)}: give LO HI with 1 <= LO <= "
                             f"HI <= {MAX_LENGTH:,} tokens")


def check_options(args, explicit):
    """The options of `run serve` that do not apply together, refused in one line (see the
    module docstring); returns True when the arguments ask for a stream."""
    given = set(explicit)
    stream = args.requests is not None or args.trace is not None
    if args.trace is not None and "requests" in given:
        raise ValueError("--trace serves the trace's rows as the requests: drop --requests "
                         "(or drop --trace for a Poisson stream of N requests)")
    if not stream:
        extra = [o for o in STREAM_OPTIONS if o in given]
        if extra:
            raise ValueError(f"{_flag(extra[0])} shapes a request stream: give --requests N "
                             "(a Poisson stream) or --trace FILE, or drop it")
        return False
    if args.trace is not None:
        extra = [o for o in POISSON_OPTIONS if o in given]
        if extra:
            raise ValueError(f"{_flag(extra[0])} shapes the Poisson stream; the trace "
                             f"{args.trace} sets the arrivals and lengths: drop it")
    extra = [o for o in FIXED_BATCH_OPTIONS if o in given]
    if extra:
        raise ValueError(f"{_flag(extra[0])} applies to `run serve`'s fixed batch, not to a "
                         "stream (its requests come from --requests or --trace, their lengths "
                         "from --stream-prompt-len, --stream-output-len): drop it")
    if "time_gpu" in given and args.time_model is None:
        raise ValueError("--time-gpu is the GPU of --time-model: give --time-model too")
    # (disaggregated prefill sends its keys and values in blocks of --block-size: no --paged)
    if "block_size" in given and not args.paged and getattr(args, "prefill_ranks", None) is None:
        raise ValueError("--block-size sets the blocks of a paged KV cache: give --paged too "
                         "(the contiguous cache reserves each request's maximum length)")
    return True


def _flag(dest):
    return "--" + dest.replace("_", "-")


def add_arguments(parser):
    """The stream options of `run serve` (one block; --requests switches to a stream)."""
    g = parser.add_argument_group("request stream (serving systems, lesson 10)")
    g.add_argument("--requests", type=int, default=None,
                   help="serve a Poisson stream of N requests (or give --trace instead)")
    g.add_argument("--rate", type=float, default=50.0, help="Poisson arrivals per second")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="serve a recorded stream instead of --requests: CSV (header arrival_s,"
                        "prompt,output) or a JSON list of such objects; every row is checked")
    g.add_argument("--policy", choices=("static", "continuous"), default="continuous")
    g.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", type=int, default=8,
                   help="most requests running at once (vLLM's name; --max-batch: the old one)")
    g.add_argument("--paged", action="store_true", help="a paged KV cache (else contiguous)")
    g.add_argument("--block-size", type=int, default=8, help="tokens per KV block (--paged)")
    g.add_argument("--kv-tokens", type=int, default=None, help="KV token slots per rank")
    g.add_argument("--max-num-batched-tokens", "--chunk", dest="chunk", type=int, default=None,
                   help="tokens per step, decodes and prompt tokens together (vLLM's name; "
                   "--chunk: the old one)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="cut prompts to the budget left (default) or take them "
                   "whole")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=False, help="vLLM v1's automatic prefix caching of full blocks "
                   "(--paged; off by default here)")
    g.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every prompt begins with the same N-token system prompt")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                   default="fcfs", help="vLLM's: fcfs, or priority (a trace's priority column, "
                   "lower first; the lowest-priority running request is preempted)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                   help="KV blocks per rank (vLLM's name; else --kv-tokens or the default)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="the KV pool the --time-model GPU holds at this fraction of its memory "
                   "(vLLM's; weights and the activation peak come off it)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="vLLM's sampling temperature (0: greedy, the default)")
    g.add_argument("--top-p", type=float, default=1.0, help="vLLM's nucleus sampling mass")
    g.add_argument("--stream-prompt-len", type=int, nargs=2, default=(8, 32), metavar=("LO", "HI"))
    g.add_argument("--stream-output-len", type=int, nargs=2, default=(4, 16), metavar=("LO", "HI"))
    g.add_argument("--time-model", default=None,
                   help="latencies modelled for this catalog model (e.g. llama-3-8b)")
    g.add_argument("--time-gpu", default="H100", help="the GPU of --time-model")
    g.add_argument("--ttft-ms", type=float, default=None,
                   help="request_goodput's TTFT limit (ms)")
    g.add_argument("--tpot-ms", type=float, default=None,
                   help="request_goodput's TPOT limit (ms)")
    return g
