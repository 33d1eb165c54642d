"""The cluster a plan runs on (ClusterSpec): GPU, links, the software stack and precision, and
the planner's two fitted constants.

ACHIEVABLE and HBM_PASSES are fitted by published.calibrate on Narayanan et al. 2021 Table 1
(A100 80GB, Megatron-LM of 2021: stack "megatron-2021") and on nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import hardware, overlap, plan_inputs as inputs, plan_terms as terms

# The two fitted constants (calibrate() on Narayanan et al. 2021 Table 1, A100 80GB, Megatron-LM
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
    achievable: float = ACHIEVABLE   # fraction of peak bf16 FLOP/s transformer GEMMs reach
    hbm_passes: float = HBM_PASSES   # HBM reads+writes per activation byte kept, fwd+bwd
    flash_attention: bool = True     # the software stack: FlashAttention (no s^2 softmax kept)
    precision: str = "bf16"          # "bf16" mixed precision, "fp8" GEMMs (TE), "fp32" all fp32
    dropout: bool = None             # None: GPT models have dropout, Llama models do not
    stack: overlap.Stack = overlap.STACKS[overlap.DEFAULT_STACK]
    causal: bool = True              # causal masks: FlashAttention skips the masked blocks
    achievable_fp8: float = None     # fraction of peak fp8 FLOP/s (precision="fp8")

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
    """Fraction of the dense peak of `precision` that transformer GEMMs reach on `gpu`.

    Fitted on A100 (Table 1: ACHIEVABLE, or `fitted` while calibrating) and carried to other
    GPUs and to fp8 through each one's measured maximum achievable matmul FLOP/s (MAMF,
    data/hardware.csv): fitted x (MAMF / peak of gpu, precision) / (MAMF / peak of A100, bf16).
    The fit then says how far transformer shapes fall below the best matmul (0.67 / 0.869 =
    0.78), the microbenchmark how far the best matmul falls below each datasheet. A GPU without
    a measurement keeps the A100's fraction; fp8 without one keeps the GPU's bf16 fraction."""
    base = fitted or getattr(gpu, "achievable", None) or ACHIEVABLE
    reference = hardware.gpu("A100")
    if not reference.mamf_bf16_flops or not gpu.mamf_bf16_flops:
        return base
    scale = reference.mamf_bf16_flops / reference.bf16_flops
    if precision == "fp8" and gpu.mamf_fp8_flops:
        return base * gpu.mamf_fp8_flops / gpu.fp8_flops / scale
    return base * gpu.mamf_bf16_flops / gpu.bf16_flops / scale
