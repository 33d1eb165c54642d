"""Shared by the benchmarks: data/bench.csv, interleaved rounds, the median and the spread.

data/bench.csv holds one row per (benchmark, labkit_impl, torch_impl, world_size, metric): a
rerun replaces the row of the same configuration instead of appending a second one.
- labkit, torch: each side's median over the rounds;
- labkit_over_torch: the median over rounds of the per-round ratio labkit / torch (below 1:
  labkit is faster or smaller); spread_min, spread_max: the lowest and highest per-round ratio;
  rounds: how many rounds the medians are over (blank for one-shot numbers such as a max diff).
Rounds are interleaved (`interleaved_rounds`): both sides run in every round, the order
alternating, so that a machine that is busier for a while slows both sides alike.
"""
import csv
import datetime
import os
import statistics

CSV = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                   "bench.csv")
COLUMNS = ["benchmark", "labkit_impl", "torch_impl", "world_size", "metric", "labkit", "torch",
           "labkit_over_torch", "spread_min", "spread_max", "rounds", "notes", "date"]
KEY = ("benchmark", "labkit_impl", "torch_impl", "world_size", "metric")
RENAMED = {"ratio": "labkit_over_torch"}   # the column's name before it said its direction
MIN_ROUNDS = 5


def _normalise(row):
    """A row with every column, old column names renamed, values as strings."""
    out = {c: "" for c in COLUMNS}
    for k, v in row.items():
        k = RENAMED.get(k, k)
        if k not in out:
            raise ValueError(f"unknown bench.csv column {k!r}; columns: {', '.join(COLUMNS)}")
        out[k] = "" if v is None else str(v)
    return out


def _key(row):
    return tuple(str(row[k]) for k in KEY)


def read_rows(path=CSV):
    """The rows of data/bench.csv (old column names renamed), [] if there is none."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [_normalise(r) for r in csv.DictReader(f)]


def write_rows(rows, path=CSV):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(_normalise(r) for r in rows)


def replace_rows(rows, path=CSV):
    """Write result rows (dicts with COLUMNS keys; date filled in) into data/bench.csv: a row
    whose (benchmark, labkit_impl, torch_impl, world_size, metric) is already there replaces
    that row in place, a new configuration is added at the end."""
    today = datetime.date.today().isoformat()
    new = {}
    for row in rows:
        row = _normalise({**row, "date": today})
        new[_key(row)] = row                         # the last of duplicates in one call wins
    kept, placed = [], set()
    for old in read_rows(path):
        k = _key(old)
        if k in new:
            if k not in placed:
                kept.append(new[k])
                placed.add(k)
        else:
            kept.append(old)
    kept += [r for k, r in new.items() if k not in placed]
    write_rows(kept, path)


append_rows = replace_rows   # the name the benches used before rows were replaced on rerun


def median(values):
    return statistics.median(values)


def interleaved_rounds(sides, rounds=MIN_ROUNDS, warmup=1):
    """Measure each side once per round, in alternating order, after `warmup` unrecorded rounds.

    sides: {name: measure}, measure() returns one number for the round (seconds, bytes ...).
    Round 0 runs the sides in the given order, round 1 reversed, and so on. Returns {name:
    [value per recorded round]}. In a multi-rank bench every rank calls this with the same
    sides so that they stay in step.
    """
    if rounds < MIN_ROUNDS:
        raise ValueError(f"at least {MIN_ROUNDS} interleaved rounds, not {rounds}")
    names = list(sides)
    values = {name: [] for name in names}
    for r in range(warmup + rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            value = sides[name]()
            if r >= warmup:
                values[name].append(value)
    return values


def slowest_rank_timer(step):
    """A `measure()` for `interleaved_rounds` on ranks: all start together (a barrier), and the
    round's time is the slowest rank's (a MAX all-reduce), which is the step's time."""
    import time

    import torch
    import torch.distributed as dist

    def measure():
        dist.barrier()
        start = time.perf_counter()
        step()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return took.item()
    return measure


def slowest_rank_rounds(results, side, rounds):
    """Per round, the median step of the slowest rank (each step's max over ranks).

    results: one dict per rank, {side: [round, ...]}, each round {"step_wall_s": [seconds]}.
    """
    per_round = []
    for rnd in range(rounds):
        per_rank = [r[side][rnd]["step_wall_s"] for r in results]
        per_round.append(statistics.median(max(ts) for ts in zip(*per_rank)))
    return per_round


def side_steps(results, sides, rounds):
    """Per side: the median over rounds of `slowest_rank_rounds`, those rounds, and rank 0's
    peak bytes of its first round ({"peak": ...} in each round's dict)."""
    out = {}
    for side in sides:
        per_round = slowest_rank_rounds(results, side, rounds)
        out[side] = dict(step=statistics.median(per_round), rounds=per_round,
                         peak=results[0][side][0]["peak"])
    return out


def summary(labkit_values, torch_values):
    """Medians of both sides and the per-round ratio labkit / torch: median, min, max."""
    if len(labkit_values) != len(torch_values) or not labkit_values:
        raise ValueError("one value per round for each side, the same number of rounds")
    ratios = [a / b for a, b in zip(labkit_values, torch_values)]
    return dict(labkit=statistics.median(labkit_values), torch=statistics.median(torch_values),
                labkit_over_torch=statistics.median(ratios), spread_min=min(ratios),
                spread_max=max(ratios), rounds=len(ratios))


def compared_row(base, metric, labkit_values, torch_values, notes="", value_format="{:.4e}"):
    """A bench.csv row for one metric measured on both sides in interleaved rounds.
    base: benchmark, labkit_impl, torch_impl, world_size. The notes end with the machine's
    load when the row is written (a busy machine widens the spread)."""
    s = summary(labkit_values, torch_values)
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    notes = f"{notes}; {load}" if notes else load
    return dict(base, metric=metric, labkit=value_format.format(s["labkit"]),
                torch=value_format.format(s["torch"]),
                labkit_over_torch=f"{s['labkit_over_torch']:.2f}",
                spread_min=f"{s['spread_min']:.2f}", spread_max=f"{s['spread_max']:.2f}",
                rounds=s["rounds"], notes=notes)
