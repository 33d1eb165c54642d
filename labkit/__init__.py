"""labkit: run, measure and model the ways large networks are trained on many GPUs.

    import labkit
    labkit.launch(fn, world_size=4)            # fn(ctx) on 4 ranks (gloo on CPU, NCCL on GPUs)
    ctx = labkit.context()                     # the process's context, also outside launch
    model = labkit.DataParallel(model)         # the building blocks, PyTorch's API shapes

Every name is imported on first use (PEP 562): `import labkit`, `python -m labkit --help`,
`plan` and `memory` never import torch (seconds on a laptop).
"""
import importlib
import signal
import threading

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
    "DistributedDataParallel": "labkit.parallel.data_parallel",
    "HybridParallel": "labkit.parallel.hybrid",
    "ShardedOptimizer": "labkit.parallel.zero",
    "FullyShard": "labkit.parallel.fully_shard",
    "parallelize": "labkit.parallel.tensor_parallel",
    "ColumnParallelLinear": "labkit.parallel.tensor_parallel",
    "RowParallelLinear": "labkit.parallel.tensor_parallel",
    "PipelineStage": "labkit.parallel.pipeline",
    "PipelineSchedule": "labkit.parallel.pipeline",
    "split_into_stages": "labkit.parallel.pipeline",
    "ExpertParallel": "labkit.parallel.moe",
    "ContextParallel": "labkit.parallel.context_parallelism",
    "ring_attention": "labkit.parallel.context_parallelism",
    "ulysses_attention": "labkit.parallel.context_parallelism",
    "ZeroBubbleSchedule": "labkit.parallel.zero_bubble",
}

__all__ = list(_LAZY)


def import_whole(module_name):
    """Import a module (and torch with it) in one piece: a Ctrl-C meanwhile is held (SIGINT
    blocked) until the import is done, then delivered as KeyboardInterrupt. Left alone, torch's
    import loses an interrupt that lands in some of its parts (the run then goes on), and a
    half-imported torch stays broken in a live kernel."""
    if threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "pthread_sigmask"):
        return importlib.import_module(module_name)
    was = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return importlib.import_module(module_name)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, was)   # a held Ctrl-C arrives now


def __getattr__(name):
    if name in _LAZY:
        value = getattr(import_whole(_LAZY[name]), name)
        globals()[name] = value   # later uses skip this function
        return value
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
