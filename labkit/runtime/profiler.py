"""`torch.profiler` on one rank of a run: PyTorch's own measured trace beside the lab's timeline.

The lab's timeline (clock.py, trace.py) records what the program *meant*: compute regions and
each collective, on a modelled cluster and at this machine's wall clock. `torch.profiler`
records what PyTorch *ran*: every aten operator, autograd node and c10d / gloo collective, with
its measured CPU time. Both export the same Chrome trace JSON (Perfetto opens either), so a
learner can open the two files of one run side by side.

    out = launch(profiled, 2, dp.train, cfg, path="dp_profile.json")   # rank 0 is profiled
    out[0]["profile"]["top_ops"], out[0]["profile"]["collectives"], out[0]["result"]

Only the chosen rank runs under the profiler (the others run `fn` plainly): profiling every
process of a CPU run doubles its cost and writes one file per rank. CPU activity only;
`record_shapes` off (it slows every op and the shapes are not needed to read the trace).
"""
import json
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

COLLECTIVE_PREFIXES = ("gloo:", "nccl:")   # the backend's own events, one per collective


def profiled(ctx, fn, *args, path=None, rank=0, top=5, **kwargs):
    """Run `fn(ctx, *args, **kwargs)`; on `rank` under `torch.profiler` (CPU activity), its
    Chrome trace written to `path` when given. Returns {"result": fn's result, "profile": the
    summary (see `summarize`) on `rank`, None on the others}."""
    if ctx.rank != rank:
        return dict(result=fn(ctx, *args, **kwargs), profile=None)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        result = fn(ctx, *args, **kwargs)
    if path is not None:
        prof.export_chrome_trace(str(path))
    return dict(result=result, profile=summarize(prof, top=top, path=path))


def summarize(prof, top=5, path=None):
    """What a profile says, as plain data: the `top` operators by self CPU time
    [(name, self CPU µs, calls)], the collectives the backend ran {name: count} (gloo:all_reduce,
    ...), the number of distinct operator names, and where its trace was written."""
    averages = prof.key_averages()
    ranked = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)
    collectives = {a.key: a.count for a in averages if a.key.startswith(COLLECTIVE_PREFIXES)}
    return dict(top_ops=[(a.key, a.self_cpu_time_total, a.count) for a in ranked[:top]],
                collectives=collectives, operator_names=len(averages),
                path=None if path is None else str(path))


def trace_events(path):
    """The complete ("X") events of a Chrome trace file, whoever wrote it (torch.profiler or
    `trace.to_trace`): a list of dicts with name, ts and dur in µs, pid and tid."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def collective_counts(events):
    """{name: count} of a trace's backend collective events (gloo:all_reduce, ...)."""
    return dict(Counter(e["name"] for e in events
                        if str(e.get("name", "")).startswith(COLLECTIVE_PREFIXES)))
