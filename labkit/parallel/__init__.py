"""The techniques as building blocks: any nn.Module, any process group, with or without launch.

Each block mirrors the PyTorch API a learner meets later (DDP, ZeroRedundancyOptimizer,
fully_shard, parallelize_module, pipelining) and takes `group=None` (the world) or a sub-group.
What they share lives in `flat.py` (FlatBuffer, bucket_params, average_gradients,
all_gather_objects, unwrapped_name); `mixed_precision.py` has MasterWeights (fp32 masters);
`tensor_parallel_plan.py` reads a TP plan; `paged_kv.py` holds the paged KV cache and the
ragged forward through it that the serving systems (batching, speculative, disaggregated)
share; `mappings.py` the autograd collectives (f, g, gather/scatter along a dim, all-to-all
of rows) the techniques are built from; `scoped_mode.py` the TorchFunctionMode that is on while
chosen modules run (context parallelism's router, selective recompute); `kv_cache.py`
generation's KV cache (serving, the pipeline's Hugging Face adapter); `self_check.py` a
block's check of itself on a miniature of the model it is given, against one device, before the
first step (`parallelize` refuses a plan that would train wrong in one line; `verify=False`
skips it).
Techniques never import each other; hybrid.py composes them.
"""
import sys
import types

# `from labkit.parallel import FullyShard` works, and importing the package imports no block:
# each name is imported on first use (PEP 562), from the one module that defines it. (The
# function `ring_attention` is `labkit.ring_attention`: here the name is its module's.)
_BLOCKS = {
    "DataParallel": "data_parallel",
    "DistributedDataParallel": "data_parallel",
    "ShardedOptimizer": "zero",
    "FullyShard": "fully_shard",
    "fully_shard": "fsdp2",
    "FSDPModule": "fsdp2",
    "MixedPrecisionPolicy": "fsdp2",
    "OffloadPolicy": "fsdp2",
    "CPUOffloadPolicy": "fsdp2",
    "parallelize": "tensor_parallel",
    "parallelize_module": "parallel_styles",
    "ColwiseParallel": "parallel_styles",
    "RowwiseParallel": "parallel_styles",
    "SequenceParallel": "parallel_styles",
    "PrepareModuleInput": "parallel_styles",
    "ParallelStyle": "parallel_styles",
    "Replicate": "parallel_styles",
    "Shard": "parallel_styles",
    "loss_parallel": "parallel_styles",
    "ColumnParallelLinear": "tensor_parallel",
    "RowParallelLinear": "tensor_parallel",
    "PipelineStage": "pipeline",
    "PipelineSchedule": "pipeline",
    "split_into_stages": "pipeline",
    "ZeroBubbleSchedule": "zero_bubble",
    "ScheduleGPipe": "pipeline",
    "Schedule1F1B": "pipeline",
    "ScheduleInterleaved1F1B": "pipeline",
    "ScheduleInterleavedZeroBubble": "zero_bubble",
    "ExpertParallel": "moe",
    "ContextParallel": "context_parallelism",
    "context_parallel": "context_parallelism",
    "ulysses_attention": "context_parallelism",
    "context_parallel_batch": "context_batch",
    "cache_for": "serving",
    "tp_plan_for": "tp_presets",
    "KVCache": "kv_cache",
    "generate": "serving",
    "PipelineGenerator": "serving",
    "HybridParallel": "hybrid",
    "MasterWeights": "mixed_precision",
    "checkpoint_attention_cores": "recompute",
}
__all__ = sorted(_BLOCKS)


class _Package(types.ModuleType):
    """`fully_shard` is torch's function here (as in torch.distributed.fsdp): importing the
    module parallel/fully_shard.py (FSDP1's FullyShard) must not rebind the name to it.
    (torch's `context_parallel` has no such clash: its module is context_parallelism.py.)"""

    def __setattr__(self, name, value):
        if not (name == "fully_shard" and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)

    def __reduce__(self):
        # pickled by name, as a plain module is: `launch` sends a function whose globals
        # hold `import labkit.parallel as lp` to its ranks (cloudpickle knows only ModuleType)
        import importlib
        return importlib.import_module, (self.__name__,)


sys.modules[__name__].__class__ = _Package


def __getattr__(name):
    if name in _BLOCKS:
        import importlib
        value = getattr(importlib.import_module(f"{__name__}.{_BLOCKS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_BLOCKS))
