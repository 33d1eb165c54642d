"""labkit: run, measure and model the ways large networks are trained on many GPUs.

    import labkit
    labkit.launch(fn, world_size=4)            # fn(ctx) on 4 ranks (gloo on CPU, NCCL on GPUs)
    ctx = labkit.context()                     # the process's context, also outside launch
    model = labkit.DataParallel(model)         # the building blocks, PyTorch's API shapes
"""
import importlib

from .runtime import Context, LaunchError, launch
from .runtime.context import Group, context
from .runtime.mesh import Mesh

__version__ = "0.2.0"

# Building blocks, imported on first use (so `import labkit` stays quick): name -> module.
_BLOCKS = {
    "DataParallel": "labkit.parallel.data_parallel",
    "ShardedOptimizer": "labkit.parallel.zero",
    "FullyShard": "labkit.parallel.fully_shard",
    "parallelize": "labkit.parallel.tensor_parallel",
    "ColumnParallelLinear": "labkit.parallel.tensor_parallel",
    "RowParallelLinear": "labkit.parallel.tensor_parallel",
    "PipelineStage": "labkit.parallel.pipeline",
    "PipelineSchedule": "labkit.parallel.pipeline",
    "split_into_stages": "labkit.parallel.pipeline",
    "ExpertParallel": "labkit.parallel.moe",
    "ContextParallel": "labkit.parallel.context_parallel",
    "ring_attention": "labkit.parallel.context_parallel",
    "ulysses_attention": "labkit.parallel.context_parallel",
    "ZeroBubbleSchedule": "labkit.parallel.zero_bubble",
}

__all__ = ["Context", "Group", "LaunchError", "Mesh", "context", "launch", *_BLOCKS]


def __getattr__(name):
    if name in _BLOCKS:
        return getattr(importlib.import_module(_BLOCKS[name]), name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
