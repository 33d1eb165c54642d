"""labkit: run, measure and model the ways large networks are trained on many GPUs.

    import labkit
    labkit.launch(fn, world_size=4)            # fn(ctx) on 4 ranks (gloo on CPU, NCCL on GPUs)
    ctx = labkit.context()                     # the process's context, also outside launch
    model = labkit.DataParallel(model)         # the building blocks, PyTorch's API shapes

Every name is imported on first use (PEP 562): `import labkit`, `python -m labkit --help`,
`plan` and `memory` never import torch (seconds on a laptop).
"""
import importlib

__version__ = "0.2.0"

# name -> the module that defines it, imported when the name is first used
_LAZY = {
    "Context": "labkit.runtime.context",
    "Group": "labkit.runtime.context",
    "context": "labkit.runtime.context",
    "LaunchError": "labkit.runtime.launch",
    "launch": "labkit.runtime.launch",
    "Mesh": "labkit.runtime.mesh",
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
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value   # later uses skip this function
        return value
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
