"""The techniques as building blocks: any nn.Module, any process group, with or without launch.

Each block mirrors the PyTorch API a learner meets later (DDP, ZeroRedundancyOptimizer,
fully_shard, parallelize_module, pipelining) and takes `group=None` (the world) or a sub-group.
What they share lives in `flat.py` (FlatBuffer, bucket_params, average_gradients,
all_gather_objects, unwrapped_name); `mixed_precision.py` has MasterWeights (fp32 masters);
`tensor_parallel_plan.py` reads a TP plan; `paged_kv.py` holds the paged KV cache and the
ragged forward through it that the serving systems (batching, speculative, disaggregated)
share. Techniques never import each other; hybrid.py composes them.
"""
