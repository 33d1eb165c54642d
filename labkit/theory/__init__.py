"""Closed-form theory for the lab: hardware and model tables, memory and time formulas.

Nothing here runs distributed code: only the standard library, pandas and math.
"""
from . import catalog, hardware, memory, pipeline, tensor_parallel, time
from .catalog import ModelShape, model, models
from .hardware import GPU, Cluster, Link, cluster, gpu, gpus, link, links
from .memory import (activation_bytes_per_layer, inference_memory, largest_trainable_params,
                     model_state_bytes, tiny_gpt_activation_bytes, training_memory,
                     zero_stage_table)
from .time import (bubble_fraction, bubble_over_ideal, collective_time, dp_speedup, dp_step_time,
                   training_flops, wire_bytes_per_rank)

__all__ = [
    "catalog", "hardware", "memory", "pipeline", "time",
    "ModelShape", "model", "models", "GPU", "Cluster", "Link", "cluster", "gpu", "gpus", "link",
    "links", "activation_bytes_per_layer", "inference_memory", "largest_trainable_params",
    "model_state_bytes", "tiny_gpt_activation_bytes", "training_memory", "zero_stage_table",
    "bubble_fraction",
    "bubble_over_ideal", "collective_time", "dp_speedup", "dp_step_time", "training_flops",
    "wire_bytes_per_rank",
]
