"""A run's timeline as a Chrome trace (the JSON `torch.profiler` writes; Perfetto and
chrome://tracing open it), and the exposed vs hidden time of each collective.

The timeline is the clock's events of every rank (`ctx.clock.timeline()`, a report's
`timeline`). Each rank becomes two trace processes, so the two time bases never mix:
  "rank r · modelled on CLUSTER": thread "compute" (compute bars, blocking collectives and the
      waits, from counted FLOPs and the alpha-beta model), "comm" (async collectives, one at a
      time: the comm stream), "send" and "recv" (p2p messages, which may overlap);
  "rank r · measured wall, this machine": the same events at their wall-clock times (seconds
      since the rank started; a collective from its issue to the moment its result was there).
Each event is {"name", "ph": "X", "ts", "dur", "pid", "tid", "args"} with ts and dur in
microseconds (the format's unit; modelled times of a tiny model are fractions of one).
"""
import json

from . import atomic

THREADS = ("compute", "comm", "send", "recv")   # tids 0-3 of every trace process
US = 1e6


def trace_events(timeline, cluster=None):
    """The Chrome trace events of `timeline`, sorted by process, thread and start time, after
    the metadata events that name the processes and threads."""
    ranks = sorted({e["rank"] for e in timeline})
    world = (max(ranks) + 1) if ranks else 0
    modelled = f"modelled on {cluster}" if cluster else "modelled"
    names = {}
    for rank in ranks:
        names[rank] = f"rank {rank} · {modelled}"
        names[world + rank] = f"rank {rank} · measured wall, this machine"
    events = []
    for e in timeline:
        # p2p messages have threads of their own: a send and a recv run at once (full duplex)
        lane = e["kind"] if e["kind"] in ("send", "recv") else e["lane"]
        tid = THREADS.index(lane) if lane in THREADS else 0
        args = dict(kind=e["kind"], **_plain(e.get("meta", {})))
        for key in ("exposed_s", "hidden_s"):
            if key in args:
                args[key.replace("_s", "_us")] = args.pop(key) * US
        events.append(_x(e["name"], e["start"], e["end"], e["rank"], tid, args))
        if e["kind"] != "idle":   # a wait has no wall duration of its own
            events.append(_x(e["name"], e["wall_start"], e["wall_end"], world + e["rank"],
                             tid, args))
    events.sort(key=lambda ev: (ev["pid"], ev["tid"], ev["ts"], -ev["dur"]))
    meta = []
    for pid, name in sorted(names.items()):
        meta.append(dict(name="process_name", ph="M", pid=pid, tid=0, args=dict(name=name)))
        meta.append(dict(name="process_sort_index", ph="M", pid=pid, tid=0,
                         args=dict(sort_index=pid)))
        for tid, thread in enumerate(THREADS):
            meta.append(dict(name="thread_name", ph="M", pid=pid, tid=tid,
                             args=dict(name=thread)))
    return meta + events


def to_trace(timeline, path=None, cluster=None, **metadata):
    """The trace as a dict {"traceEvents": [...], "displayTimeUnit": "ns", ...}; written to
    `path` as JSON when given (open it at ui.perfetto.dev or chrome://tracing)."""
    trace = dict(traceEvents=trace_events(timeline, cluster), displayTimeUnit="ns",
                 otherData=dict(_plain(metadata), units="microseconds",
                                note="modelled and measured times are separate processes"))
    if path is not None:
        atomic.write_json(path, trace)   # whole or not at all: never half a trace
    return trace


def overlap_by_op(timeline, rank=None):
    """Modelled seconds of each collective (by name) split into exposed (compute waited for
    it) and hidden (it ran under compute), summed over the calls of `rank` (None: every rank):
    {op: {"calls", "modelled_s", "exposed_s", "hidden_s"}}."""
    out = {}
    for e in timeline:
        meta = e.get("meta", {})
        if "exposed_s" not in meta or rank not in (None, e["rank"]):
            continue
        row = out.setdefault(e["name"], dict(calls=0, modelled_s=0.0, exposed_s=0.0,
                                             hidden_s=0.0))
        row["calls"] += 1
        row["modelled_s"] += e["end"] - e["start"]
        row["exposed_s"] += meta["exposed_s"]
        row["hidden_s"] += meta["hidden_s"]
    return out


def hidden_share(overlap, ops=None):
    """Hidden / modelled seconds of the ops named (None: all), from an `overlap_by_op` result
    (op names are matched by their first word: a p2p ring's messages show as "recv from r")."""
    rows = [row for name, row in overlap.items()
            if ops is None or name.split(" ")[0] in ops]
    total = sum(r["modelled_s"] for r in rows)
    return dict(modelled_s=total, exposed_s=sum(r["exposed_s"] for r in rows),
                hidden_s=sum(r["hidden_s"] for r in rows),
                share=sum(r["hidden_s"] for r in rows) / total if total else 0.0)


def _x(name, start, end, pid, tid, args):
    return dict(name=name, ph="X", ts=start * US, dur=max(0.0, end - start) * US, pid=pid,
                tid=tid, args=args)


def _plain(values):
    """JSON-able values (tensors, tuples and other objects become lists or strings)."""
    return json.loads(json.dumps(values, default=lambda v: v.tolist() if hasattr(v, "tolist")
                                 else str(v)))
