"""The run report: one dict per run, the same for the CLI, tests and notebooks
(docs/architecture.md, Contracts).

Each rank's `fn` returns `rank_result(ctx, ...)`; `build_report` puts the ranks together with
the single-device reference's result it is handed (`reference.train(cfg)`, or a technique's
own reference) and adds `max_param_diff_vs_reference`, and, when it is handed the same run in
float64 (`exact`), `agreement`: the parallel run and the float32 reference both measured
against the float64 run (labkit.numerics), the verdict "equals one device" that holds on any
CPU. A driver's `report` runs its ranks with `launch_checked` (the CLI's one-line refusals
first) and hands `build_report` the references of `single_device(cfg)`.
"""
import dataclasses
import json
import math
import numbers

import torch

from .trainer import rank_result  # noqa: F401  (what each rank hands back; drivers import it here)


def launch_checked(technique, train, world_size, cfg, options, check=None, cli_options=None,
                   **launch_options):
    """The ranks' results of `train(ctx, cfg, **options)` on `world_size` ranks, after the
    checks `python -m labkit run` makes: the preflight's one-line refusal of options no run can
    take and of a run that cannot fit here (runs/preflight.py), then the technique's `check()`.
    A lesson calling a driver's `report` is refused as the CLI is, before any rank starts.
    `cli_options`: the options as the CLI names them, where `train` takes them in another form
    (MoE's `moe=MoEConfig(...)` is `experts=`, `top_k=`, ... there)."""
    from ..runtime.launch import launch
    from .preflight import check_run
    check_run(technique, cfg, world_size, options if cli_options is None else cli_options)
    if check is not None:
        check()
    return launch(train, world_size, cfg, **options, **launch_options)


def single_device(cfg):
    """{reference, exact}: the single-device run of `cfg` (reference.train) and the same run in
    float64, what `build_report` judges a run against."""
    from .reference import float64_reference, train
    return dict(reference=train(cfg), exact=float64_reference(cfg))


def sweep_runs(ctx, cfg, runs, train):
    """Several runs of a driver's `train(ctx, cfg, **run)` in one launch (starting ranks is the
    slow part on a laptop): one result per run.

    runs: list of dicts of `train` keywords, plus optional 'cluster' (for the clock) and
    'steps'. Each run gets a fresh clock, comm log and memory tracker."""
    out, launched_on = [], ctx.clock.cluster
    for run in runs:
        run = dict(run)
        ctx.reset_instruments(run.pop("cluster", launched_on))
        steps = run.pop("steps", cfg.steps)
        out.append(train(ctx, dataclasses.replace(cfg, steps=steps), **run))
    return out


def mean_loss(results, key="local_loss"):
    """The full-batch loss per step: the mean over ranks of each rank's shard loss (equal
    shards: the mean of the means is the mean)."""
    per_rank = [r[key] for r in results]
    return [sum(step) / len(step) for step in zip(*per_rank)]


def build_report(technique, cfg, results, *, reference, exact=None, config=None,
                 predicted_memory=None, predicted_comm_bytes_per_rank=None, **extra):
    """The JSON-able report of a run, plus `timeline` and `params` for notebooks.
    `reference`: the single-device run's result ({loss, params}) the ranks are checked
    against; `exact`: the same run in float64 (`reference.float64_reference(cfg)`), for
    `agreement`."""
    from .reference import max_param_diff
    first = results[0]
    params = first.get("params")
    step_times = first["modelled_step_s"]
    report = dict(
        technique=technique, world_size=len(results), backend=first["backend"],
        cluster=first["cluster"], config=dict(cfg.as_dict(), **(config or {})),
        steps=cfg.steps, loss=first["loss"], reference_loss=reference["loss"],
        max_param_diff_vs_reference=(max_param_diff(params, reference["params"])
                                     if params is not None else None),
        memory={r["rank"]: r["memory"] for r in results},
        predicted_memory=predicted_memory,
        comm=first["comm"],
        predicted_comm_bytes_per_rank=predicted_comm_bytes_per_rank,
        wall_s=max(r["wall_s"] for r in results),
        modelled_step_s=max(step_times[1:] or step_times) if step_times else None,
    )
    report["agreement"] = agreement(report["loss"], params, reference, exact)
    report.update(extra)
    report["timeline"] = [e for r in results for e in r["timeline"]]
    report["params"] = params
    return report


def agreement(loss, params, reference, exact):
    """{"loss": ..., "params": ...}: each a dict of `numerics.Agreement`'s numbers and `ok`
    (None without a float64 run, or without gathered parameters)."""
    from .. import numerics
    if exact is None:
        return None
    found = dict(loss=numerics.compare_loss(loss, reference["loss"], exact["loss"]))
    if params is not None:
        found["params"] = numerics.compare(params, reference["params"], exact["params"])
    return {k: dict(error=a.error, own_error=a.own_error, limit=a.limit, ok=a.ok,
                    verdict=str(a)) for k, a in found.items()}


def diverged_at(loss):
    """The first step whose loss is not finite (NaN or infinite: the run diverged), or None."""
    return next((step for step, value in enumerate(loss)
                 if not math.isfinite(float(value))), None)


def to_json(report, timeline=False):
    """The report as JSON text: tensors as lists, (unless asked) the timeline left out.

    Valid JSON whatever the numbers: a NaN or infinite float (a loss that diverged) becomes
    null, and `non_finite` lists where, e.g. ["loss[2]"] (json.dumps never hands a float to
    `default`, so they are replaced before, and allow_nan=False proves none is left).
    """
    skip = {"params"} | (set() if timeline else {"timeline"})
    flagged = []
    plain = _finite({k: v for k, v in report.items() if k not in skip}, "", flagged)
    if flagged:
        plain["non_finite"] = flagged
    return json.dumps(plain, indent=2, allow_nan=False)


def to_trace(report, path):
    """Write the run's timeline (every rank; modelled and measured wall lanes) as Chrome trace
    JSON for Perfetto (runtime/trace.py); returns the trace dict."""
    from ..runtime.trace import to_trace as timeline_to_trace
    return timeline_to_trace(report["timeline"], path, cluster=report.get("cluster"),
                             technique=report["technique"], world_size=report["world_size"])


def _finite(value, where, flagged):
    """`value` as plain JSON data, each NaN/inf float replaced by None and its path noted."""
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        value = value.tolist()   # numpy's scalars too: Python's own bool, int, float
    if isinstance(value, dict):
        return {str(k): _finite(v, f"{where}.{k}" if where else str(k), flagged)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, f"{where}[{i}]", flagged) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, str)):   # before numbers: a bool is a Real
        return value
    if isinstance(value, numbers.Integral):
        return int(value)   # numpy's integers too
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            flagged.append(where)
            return None
        return value
    return str(value)


def format_table(report):
    """A short human-readable summary of a report (what the CLI prints without --json)."""
    lines = [f"{report['technique']} on {report['world_size']} rank(s), {report['backend']}, "
             f"modelled on {report['cluster']}"]
    for step, (a, b) in enumerate(zip(report["loss"], report["reference_loss"])):
        lines.append(f"  step {step}: loss {a:.5f}   reference {b:.5f}")
    diff = report["max_param_diff_vs_reference"]
    if diff is not None:
        lines.append(f"  max |param - reference| after the last step: {diff:.2e}")
    for name, a in (report.get("agreement") or {}).items():
        lines.append(f"  {name} vs the float64 single-device run: {a['verdict']}")
    lines.append("  memory per rank (measured, MB): " + ", ".join(
        f"r{r}: params {m['params'] / 1e6:.2f} grads {m['grads'] / 1e6:.2f} "
        f"opt {m['optimizer'] / 1e6:.2f} act {m['activations'] / 1e6:.2f} "
        f"peak {m['peak'] / 1e6:.2f}" for r, m in report["memory"].items()))
    for row in report["comm"]:
        lines.append(f"  comm {row['op']:>14}: {row['calls']:4d} calls, {row['bytes']:>10d} B, "
                     f"wire/rank {row['wire_bytes_per_rank']:>12.0f} B")
    for key in ("bubble_fraction", "tokens_dropped", "expert_load"):
        if report.get(key) is not None:
            lines.append(f"  {key.replace('_', ' ')}: {report[key]}")
    lines.append(f"  wall clock (measured, this machine): {report['wall_s']:.2f} s")
    if report["modelled_step_s"] is not None:
        lines.append(f"  step time (modelled on {report['cluster']}): "
                     f"{report['modelled_step_s'] * 1e6:.1f} us")
    return "\n".join(lines)
