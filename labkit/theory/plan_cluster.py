"""The cluster a plan runs on (ClusterSpec): GPU, links, the software stack and precision, and
the planner's constants.

GEMMs run at the kernel model's efficiency (theory/kernels.py: the GPU's measured MAMF ceiling x
each kernel's tile and wave quantization, data/kernels.csv) and element-wise kernels at their own
bytes (plan_terms.elementwise_time); inside a step GEMMs run at `in_step_gemm_fraction` of
that rate, the one number fitted (on the calibration rows only): together, theory/step_rate.py's
in_step_gemm_rate, the run clock's rate too. `achievable`
overrides the bf16 GEMM ceiling with a fraction of the user's own (a measured GPU, a what-if).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from . import hardware, kernels, overlap, plan_inputs as inputs, plan_terms as terms
from .step_rate import achievable_fraction, in_step_gemm_rate  # noqa: F401  (theirs, here too)


@dataclass(frozen=True)
class ClusterSpec:
    gpu: hardware.GPU
    gpus: int
    gpus_per_node: int = 8
    intra: hardware.Link = None
    inter: hardware.Link = None
    achievable: float = None         # bf16 GEMM ceiling: MAMF / peak (achievable_fraction)
    flash_attention: bool = True     # the software stack: FlashAttention (no s^2 softmax kept)
    precision: str = "bf16"          # "bf16" mixed precision, "fp8" GEMMs (TE), "fp32" all fp32
    dropout: bool = None             # None: GPT models have dropout, Llama models do not
    stack: overlap.Stack = overlap.STACKS[overlap.DEFAULT_STACK]
    causal: bool = True              # causal masks: FlashAttention skips the masked blocks
    achievable_fp8: float = None     # fp8 GEMM ceiling (precision="fp8")
    kernel_launch_s: float = kernels.LAUNCH_S   # per kernel (data/kernels.csv)
    fp8_recipe: str = "delayed"      # TE scaling: "current" reads each tensor twice to cast it
    # GEMMs inside a step against the microbenchmark's (data/kernels.csv: a declared
    # fit on the calibration rows, published.fit_in_step_gemm_fraction)
    in_step_gemm_fraction: float = kernels.IN_STEP_GEMM_FRACTION

    def link(self, span):
        """The link of a group whose members lie within `span` consecutive ranks."""
        return self.intra if span <= self.gpus_per_node else self.inter

    def ring_link(self, group_size, span):
        """The link a ring collective (all-reduce, all-gather, reduce-scatter) of `group_size`
        ranks spread evenly over `span` consecutive ranks runs at. Across nodes NCCL lays one
        ring per channel and each channel crosses between nodes through the NIC of a different
        member (one NIC per GPU), so a node's k members move the ring's bytes over k NICs at
        once: k x the NIC's bandwidth, never faster than the node's own link (NVLink). With
        one member per node (TP filling the node) it is one NIC; inside a node, NVLink."""
        if span <= self.gpus_per_node:
            return self.intra
        per_node = max(1, group_size * self.gpus_per_node // span)
        if per_node == 1:
            return self.inter
        wide = min(per_node * self.inter.effective_bandwidth, self.intra.effective_bandwidth)
        return replace(self.inter, name=f"{self.inter.name} x {per_node} NICs",
                       bandwidth=wide / self.inter.efficiency)

    @property
    def capacity_bytes(self):
        return self.gpu.memory_bytes

    @property
    def usable_bytes(self):
        """What plans may fill: the GPU's memory less the allocator reserve (its own term)."""
        return self.gpu.memory_bytes - terms.ALLOCATOR_RESERVE


def make_cluster(gpu="H100", gpus=8, gpus_per_node=None, intra_link=None, inter_link=None,
                 achievable=None, flash_attention=True, precision="bf16",
                 dropout=None, stack=None, causal=True, fp8_recipe="delayed",
                 in_step_gemm_fraction=None):
    g = gpu if isinstance(gpu, hardware.GPU) else _gpu(gpu)
    gpus = inputs.count("gpus", gpus)
    gpus_per_node = inputs.count("gpus_per_node", g.nvlink_domain if gpus_per_node is None
                                 else gpus_per_node)     # 0 is refused, not defaulted
    inputs.choice(precision, inputs.PRECISIONS, "--precision")
    inputs.choice(fp8_recipe, inputs.FP8_RECIPES, "--fp8-recipe")
    if precision == "fp8":
        g.flops("fp8")      # a GPU without fp8 tensor cores ends here, saying so
    intra = _link(intra_link or g.link, "--intra-link")
    inter = _link(inter_link or "InfiniBand NDR", "--inter-link")
    return ClusterSpec(g, gpus, gpus_per_node, intra, inter,
                       achievable_fraction(g, "bf16", achievable), flash_attention,
                       precision, dropout, overlap.stack(stack or overlap.DEFAULT_STACK), causal,
                       achievable_fraction(g, "fp8", achievable) if g.fp8_flops else None,
                       fp8_recipe=fp8_recipe,
                       in_step_gemm_fraction=kernels.IN_STEP_GEMM_FRACTION
                       if in_step_gemm_fraction is None else in_step_gemm_fraction)


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
