"""The techniques as building blocks: any nn.Module, any process group, with or without launch.

Each block mirrors the PyTorch API a learner meets later (DDP, ZeroRedundancyOptimizer,
fully_shard, parallelize_module, pipelining) and takes `group=None` (the world) or a sub-group.
"""
