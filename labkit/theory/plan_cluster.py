"""The cluster a plan runs on (ClusterSpec): GPU, links, the software stack and precision, and
the planner's two fitted constants.

ACHIEVABLE and HBM_PASSES are fitted by published.calibrate on Narayanan et al. 2021 Table 1
(A100 80GB, Megatron-LM of 2021: stack "megatron-2021") and on nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import hardware, overlap, plan_inputs as inputs, plan_terms as terms

# The two fitted constants (calibrate() on Narayanan et al. 2021 Table 1, A100 80GB, Megatron-LM
# of 2021: stack "megatron-2021"). ACHIEVABLE: large bf16 GEMMs reach ~68% of the A100's 312
# TFLOP/s (cuBLAS reaches 70-80% on big square GEMMs; transformer shapes are less regular).
# HBM_PASSES: element-wise kernels read and write each activation byte a layer keeps ~7 times
# over forward and backward (unfused norms, GELU, softmax, dropout and residuals each read their
# input and write their output). GPUs without their own `achievable` inherit it.
ACHIEVABLE = 0.68
HBM_PASSES = 7.25


@dataclass(frozen=True)
class ClusterSpec:
    gpu: hardware.GPU
    gpus: int
    gpus_per_node: int = 8
    intra: hardware.Link = None
    inter: hardware.Link = None
    achievable: float = ACHIEVABLE   # fraction of peak bf16 FLOP/s large matmuls reach
    hbm_passes: float = HBM_PASSES   # HBM reads+writes per activation byte kept, fwd+bwd
    flash_attention: bool = True     # the software stack: FlashAttention (no s^2 softmax kept)
    precision: str = "bf16"          # "bf16" mixed precision, "fp8" GEMMs (TE), "fp32" all fp32
    dropout: bool = None             # None: GPT models have dropout, Llama models do not
    stack: overlap.Stack = overlap.STACKS[overlap.DEFAULT_STACK]
    causal: bool = True              # causal masks: FlashAttention skips the masked blocks

    def link(self, span):
        """The link of a group whose members lie within `span` consecutive ranks."""
        return self.intra if span <= self.gpus_per_node else self.inter

    @property
    def capacity_bytes(self):
        return self.gpu.memory_bytes

    @property
    def usable_bytes(self):
        """What plans may fill: the GPU's memory less the allocator reserve (its own term)."""
        return self.gpu.memory_bytes - terms.ALLOCATOR_RESERVE


def make_cluster(gpu="H100", gpus=8, gpus_per_node=None, intra_link=None, inter_link=None,
                 achievable=None, hbm_passes=None, flash_attention=True, precision="bf16",
                 dropout=None, stack=None, causal=True):
    g = gpu if isinstance(gpu, hardware.GPU) else _gpu(gpu)
    gpus = inputs.count("gpus", gpus)
    gpus_per_node = inputs.count("gpus_per_node", gpus_per_node or g.nvlink_domain)
    inputs.choice(precision, inputs.PRECISIONS, "--precision")
    if precision == "fp8":
        g.flops("fp8")      # a GPU without fp8 tensor cores ends here, saying so
    intra = _link(intra_link or g.link, "--intra-link")
    inter = _link(inter_link or "InfiniBand NDR", "--inter-link")
    return ClusterSpec(g, gpus, gpus_per_node, intra, inter,
                       achievable or achievable_fraction(g),
                       HBM_PASSES if hbm_passes is None else hbm_passes, flash_attention,
                       precision, dropout, overlap.stack(stack or overlap.DEFAULT_STACK), causal)


def _gpu(name):
    try:
        return hardware.gpu(name)
    except KeyError as error:
        raise ValueError(f"--gpu: {error.args[0]} (or give --gpu-peak-tflops, --gpu-hbm-gb "
                         "and --gpu-hbm-tbps for another GPU)") from None


def _link(name, option):
    try:
        return hardware.link(name)
    except KeyError as error:
        raise ValueError(f"{option}: {error.args[0]}") from None


def achievable_fraction(gpu):
    """Fraction of dense peak large transformer matmuls reach (data/hardware.csv column
    `achievable`, fitted on A100 by `calibrate`; other GPUs inherit it unless a row says)."""
    value = getattr(gpu, "achievable", None)
    return value if value else ACHIEVABLE
