"""Which communication a training stack hides under compute, and what hiding it costs.

A collective that runs while independent compute runs is *hidden* up to the length of that
compute (the window) and *exposed* beyond it: exposed = max(floor, comm - window), where the
floor is the part no schedule can hide (the first all-gather before there is anything to compute,
the last reduce-scatter after the last gradient). Hiding is not free: the collective's kernels
hold streaming multiprocessors (SMs) that the overlapped GEMMs lose, so compute slows by
COMM_SMS / (SMs - COMM_SMS) x the hidden time (Calculon, Isaev et al. 2023, SC'23, charges
overlapped communication against compute the same way).

The stacks (a planner option, `stack=`):
- "megatron": Megatron-Core today. TP all-gather / reduce-scatter overlapped with the GEMMs
  (`--tp-comm-overlap`, Transformer Engine userbuffers; one of tp ring steps stays exposed),
  the distributed optimizer's gradient reduce-scatter overlapped with the last micro-batch's
  backward (`--overlap-grad-reduce`) and its parameter all-gather with the next step's first
  forward (`--overlap-param-gather`); pipeline sends overlapped with interleaved compute
  (`--overlap-p2p-comm`, v > 1).
- "megatron-2021": Megatron-LM as in Narayanan et al. 2021 and Korthikanti et al. 2022 (the
  calibration table): TP all-reduces exposed, the gradient all-reduce after the last backward
  hidden except one bucket, parameters gathered after the step, pipeline sends exposed.
- "fsdp2": PyTorch FSDP2 / torchtitan. ZeRO-3 (fully_shard) prefetches the next layer's
  all-gather during forward and backward and reduce-scatters each layer's gradients during
  backward; async TP overlaps TP like Megatron-Core; ZeRO 0-2 reduce gradients as DDP does
  (ZeRO-2 after every micro-batch's backward, dp_grad_reduce).
- "llama3": Meta's stack for Llama 3 (Dubey et al. 2024, arXiv 2407.21783, section 3.3.2):
  as "megatron", but context parallelism all-gathers K and V before attention instead of
  passing them round a ring, and "the all-gather communication latency is exposed in the
  critical path".
- "deepspeed": DeepSpeed ZeRO (`overlap_comm`): reduce-scatter with backward, ZeRO-3 prefetch
  as FSDP2; no TP overlap; ZeRO-1/2 parameters gathered after the step.
"""
from __future__ import annotations

from dataclasses import dataclass

# SMs a collective's kernels take from overlapped compute: NCCL runs one thread block (one SM)
# per channel and Transformer Engine's userbuffers overlap uses 16 SMs by default (`num_sm` in
# its TP-overlap config). (DeepSeek-V3's report, arXiv 2412.19437 section 3.2.2, gives 20 of
# an H800's 132 SMs to its all-to-all: the same order.)
COMM_SMS = 16


@dataclass(frozen=True)
class Stack:
    name: str
    tp_overlap: bool           # TP collectives run under the layer's GEMMs
    grad_reduce_overlap: bool  # ZeRO-1/2 reduce-scatter under backward (DDP all-reduce always)
    param_gather_overlap: bool  # ZeRO-1/2 parameter all-gather under the next forward
    p2p_overlap: bool          # pipeline sends under interleaved compute (v > 1)
    cp_overlap: bool = True    # CP's K/V ring under the attention blocks (else all exposed)


STACKS = {
    "megatron": Stack("megatron", True, True, True, True),
    "megatron-2021": Stack("megatron-2021", False, False, False, False),
    "fsdp2": Stack("fsdp2", True, True, False, False),
    "deepspeed": Stack("deepspeed", False, True, False, False),
    "llama3": Stack("llama3", True, True, True, True, cp_overlap=False),
}
DEFAULT_STACK = "megatron"


def stack(name) -> Stack:
    if isinstance(name, Stack):
        return name
    if name not in STACKS:
        raise ValueError(f"--stack must be one of {', '.join(STACKS)}, got {name!r}")
    return STACKS[name]


def hide(comm_s, window_s, floor_s=0.0):
    """(exposed, hidden) seconds of `comm_s` run beside `window_s` of independent compute;
    at least `floor_s` stays exposed."""
    exposed = min(comm_s, max(floor_s, comm_s - window_s))
    return exposed, comm_s - exposed


def tp_comm(stack_, comm_s, gemm_s, tp):
    """TP collectives of one micro-batch on one stage: (exposed, hidden). With overlap they hide
    under the GEMMs they feed or drain, except one of the tp ring steps (the chunk a ring
    exchange cannot start before, or drain after): a floor of comm / tp."""
    if not stack_.tp_overlap or tp <= 1:
        return comm_s, 0.0
    return hide(comm_s, gemm_s, comm_s / tp)


def dp_grad_reduce(stack_, comm_s, backward_s, bucket_s, zero_stage, reductions=1):
    """Gradient reductions of one step (all-reduce, or reduce-scatter under ZeRO >= 1), each of
    `comm_s`, hidden under the backward that produced its gradients (`backward_s`, one
    micro-batch's) except its last bucket, which is ready only when that backward ends.
    ZeRO-0/1 reduce once (reductions=1), under the last micro-batch's backward; ZeRO-2 after
    every micro-batch's backward (reductions = micro-batches, plan_terms.
    grad_reductions_per_step; DeepSpeed issue #2252), each under its own backward by the same
    rule. Every stack overlaps DDP's all-reduce; ZeRO-1/2's reduce-scatter only where the
    stack does (`grad_reduce_overlap`)."""
    if zero_stage >= 1 and not stack_.grad_reduce_overlap:
        return reductions * comm_s, 0.0
    exposed, hidden = hide(comm_s, backward_s, bucket_s)
    return reductions * exposed, reductions * hidden


def dp_param_gather(stack_, comm_s, forward_s, bucket_s):
    """ZeRO-1/2's all-gather of updated bf16 parameters after the optimizer step: hidden under
    the next step's first forward where the stack overlaps it, except the first bucket."""
    if not stack_.param_gather_overlap:
        return comm_s, 0.0
    return hide(comm_s, forward_s, bucket_s)


def fsdp_layer_traffic(gather_s, reduce_s, forward_s, backward_s, layers):
    """ZeRO-3 / FSDP per micro-batch, for one stage of `layers` layers: all-gather every layer
    before forward and again before backward, reduce-scatter its gradients in backward. Layer
    i+1's gather runs under layer i's compute (prefetch), so what shows is the traffic beyond
    the compute plus one layer's gather (nothing to hide the first under) and one layer's
    reduce-scatter (nothing after the last). gather_s / reduce_s: the whole stage's time."""
    layers = max(layers, 1)
    forward_traffic, backward_traffic = gather_s / 2, gather_s / 2 + reduce_s
    forward = hide(forward_traffic, forward_s, forward_traffic / layers)
    backward = hide(backward_traffic, backward_s, backward_traffic / layers)
    return forward[0] + backward[0], forward[1] + backward[1]


def pp_sends(stack_, comm_s, v):
    """Pipeline activation sends: hidden under interleaved compute where the stack overlaps
    them (Megatron's --overlap-p2p-comm needs v > 1), else exposed."""
    if stack_.p2p_overlap and v > 1:
        return 0.0, comm_s
    return comm_s, 0.0


def contention_slowdown(hidden_s, sms=132):
    """Seconds compute loses to collectives sharing its SMs: while a collective holds COMM_SMS
    of the GPU's `sms`, the compute beside it runs on the rest, so it takes sms / (sms -
    COMM_SMS) as long: hidden time x COMM_SMS / (sms - COMM_SMS)."""
    return hidden_s * COMM_SMS / (sms - COMM_SMS)
