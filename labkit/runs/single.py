"""`python -m labkit run single`: the single-device reference run as a technique of its own,
on one rank with the modelled clock running (the report every other technique is compared to).
"""
from ..runtime.launch import launch
from .reference import RunConfig, predict_memory, train
from .report import build_report, rank_result


def run(ctx, cfg):
    """The reference training on one rank, with the clock running."""
    out = train(cfg, ctx=ctx)
    return rank_result(ctx, out["loss"], params=out["params"])


def add_arguments(parser):
    """`single` has no options of its own."""


def report(world_size=1, cfg=None, cluster="8xH100-NVLink", **_):
    """Run `single` and return the run report."""
    cfg = cfg or RunConfig()
    if world_size != 1:
        raise ValueError("the single-device reference runs on exactly one rank (--world-size 1)")
    results = launch(run, 1, cfg, cluster=cluster)
    return build_report("single", cfg, results, reference=train(cfg),
                        predicted_memory=predict_memory(cfg),
                        predicted_comm_bytes_per_rank=0)
