"""The cluster a plan runs on (ClusterSpec): GPU, links, the software stack and precision, and
the planner's constants.

GEMMs run at the kernel model's efficiency (theory/kernels.py: the GPU's measured MAMF ceiling x
each kernel's tile and wave quantization, data/kernels.csv); ACHIEVABLE is no longer used by
default (it remains the value published.calibrate found on Narayanan et al. 2021 Table 1, for
comparison). HBM_PASSES is still fitted there (the element-wise term of plan_terms).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import hardware, kernels, overlap, plan_inputs as inputs, plan_terms as terms

# Fitted constants (calibrate() on Narayanan et al. 2021 Table 1, A100 80GB, Megatron-LM
# of 2021: stack "megatron-2021"; mean absolute error 1.6%). ACHIEVABLE: the GEMMs of a
# transformer reach 67% of the A100's 312 TFLOP/s (its best matmul reaches 86.9%, the MAMF
# table in data/hardware.csv; transformer shapes are less regular).
# HBM_PASSES: element-wise kernels read and write each activation byte a layer keeps ~6.5 times
# over forward and backward (unfused norms, GELU, softmax, dropout and residuals each read their
# input and write their output). Other GPUs and fp8: achievable_fraction.
ACHIEVABLE = 0.67
HBM_PASSES = 6.5


@dataclass(frozen=True)
class ClusterSpec:
    gpu: hardware.GPU
    gpus: int
    gpus_per_node: int = 8
    intra: hardware.Link = None
    inter: hardware.Link = None
    achievable: float = ACHIEVABLE   # bf16 GEMM ceiling: MAMF / peak (achievable_fraction)
    hbm_passes: float = HBM_PASSES   # HBM reads+writes per activation byte kept, fwd+bwd
    flash_attention: bool = True     # the software stack: FlashAttention (no s^2 softmax kept)
    precision: str = "bf16"          # "bf16" mixed precision, "fp8" GEMMs (TE), "fp32" all fp32
    dropout: bool = None             # None: GPT models have dropout, Llama models do not
    stack: overlap.Stack = overlap.STACKS[overlap.DEFAULT_STACK]
    causal: bool = True              # causal masks: FlashAttention skips the masked blocks
    achievable_fp8: float = None     # fp8 GEMM ceiling (precision="fp8")
    kernel_launch_s: float = kernels.LAUNCH_S   # per kernel (data/kernels.csv)

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
    gpus_per_node = inputs.count("gpus_per_node", g.nvlink_domain if gpus_per_node is None
                                 else gpus_per_node)     # 0 is refused, not defaulted
    inputs.choice(precision, inputs.PRECISIONS, "--precision")
    if precision == "fp8":
        g.flops("fp8")      # a GPU without fp8 tensor cores ends here, saying so
    intra = _link(intra_link or g.link, "--intra-link")
    inter = _link(inter_link or "InfiniBand NDR", "--inter-link")
    return ClusterSpec(g, gpus, gpus_per_node, intra, inter,
                       achievable_fraction(g, "bf16", achievable),
                       HBM_PASSES if hbm_passes is None else hbm_passes, flash_attention,
                       precision, dropout, overlap.stack(stack or overlap.DEFAULT_STACK), causal,
                       achievable_fraction(g, "fp8", achievable) if g.fp8_flops else None)


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


def achievable_fraction(gpu, precision="bf16", fitted=None):
    """Fraction of the dense peak of `precision` the best large GEMM reaches on `gpu`: the
    ceiling of theory/kernels.py's per-kernel efficiency, measured (MAMF / peak, the public
    microbenchmark in data/hardware.csv; kernels.DEFAULT_MAMF_FRACTION without one), not fitted.
    Each GEMM then runs at this x its shape efficiency. `fitted` (calibrate's grid, or the
    GPU's own `achievable` override) replaces the bf16 ceiling; fp8 keeps its ratio to bf16."""
    base = fitted or getattr(gpu, "achievable", None)
    if base is None:
        return kernels.ceiling(gpu, precision)
    return base * kernels.ceiling(gpu, precision) / kernels.ceiling(gpu, "bf16")
