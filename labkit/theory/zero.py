"""ZeRO's per-step communication and FullyShard's bytes per rank, as formulas.

Rajbhandari et al. 2020 (ZeRO, arXiv 1910.02054, sec. 7): with Ψ parameters and a ring, data
parallelism's all-reduce sends 2(N-1)/N Ψ elements per rank and step. ZeRO stage 2 replaces it
by a reduce-scatter of the gradients and an all-gather of the updated weights ((N-1)/N Ψ each:
the same 2Ψ); stage 3 gathers every unit before its forward and again before its backward:
3Ψ. Stage 1 as PyTorch's ZeroRedundancyOptimizer runs it (after DDP's all-reduce, then the
updated weights sent out) moves 2Ψ + Ψ = 3Ψ; the paper's stage 1 reduce-scatters instead (2Ψ).
Zhao et al. 2023 (PyTorch FSDP, arXiv 2304.11277) is stage 3 with units = wrapped modules.
Memory per rank (fp32 Adam): states (4 + 4 + 8/N)Ψ, (4 + 12/N)Ψ, 16Ψ/N for stages 1, 2, 3 (the
paper's Figure 1), the activations of global_batch/N examples, and stage 3's buffers: the two
largest units gathered at once.
"""
from .memory import OPTIMIZER_K, model_state_bytes
from .time import wire_bytes_per_rank


def padded(numel, world_size):
    """`numel` rounded up to a multiple of `world_size`: equal shards, fewer than N added."""
    return -(-numel // world_size) * world_size


def fully_shard_plan(unit_numels, world_size, elem_bytes, reshard_after_forward=True,
                     trainable=None):
    """One step of FullyShard as (op, payload bytes this rank hands in), unit by unit.

    Each unit's flat buffer is padded to a multiple of N: an all-gather of the 1/N shard before
    forward and (when resharded after forward) again before backward, then a reduce-scatter of
    the padded gradient unless the unit is frozen (`trainable[i]` False).
    """
    ops = []
    for i, numel in enumerate(unit_numels):
        full = padded(numel, world_size) * elem_bytes
        ops += [("all_gather", full // world_size)] * (2 if reshard_after_forward else 1)
        if trainable is None or trainable[i]:
            ops.append(("reduce_scatter", full))
    return ops


def comm_plan(flat_numels, world_size, stage, elem_bytes, reshard_after_forward=True):
    """One step's collectives as (op, payload bytes this rank hands in).

    stage 1: the averaged gradients' all-reduce and the owners' broadcasts of their updated
    parameters (`flat_numels` = [Ψ]); stage 2: per flat bucket (padded to a multiple of N), a
    reduce-scatter of its gradient and an all-gather of the updated shard; stage 3:
    `fully_shard_plan` over the units.
    """
    if stage == 1:
        psi = sum(flat_numels) * elem_bytes
        return [("all_reduce", psi), ("broadcast", psi)]
    if stage == 2:
        ops = []
        for numel in flat_numels:
            full = padded(numel, world_size) * elem_bytes
            ops += [("reduce_scatter", full), ("all_gather", full // world_size)]
        return ops
    return fully_shard_plan(flat_numels, world_size, elem_bytes, reshard_after_forward)


def plan_wire_bytes(plan, world_size):
    """Ring-model bytes per rank of a list of (op, payload bytes)."""
    return sum(wire_bytes_per_rank(op, nbytes, world_size) for op, nbytes in plan)


def formula_wire_bytes(psi, world_size, stage, elem_bytes):
    """The papers' per-rank volume of one step, ring algorithm, unpadded Ψ:
    (N-1)/N x {3, 2, 3} x Ψ x bytes for stages {1 (DP all-reduce + weights out), 2, 3}."""
    factor = {1: 3, 2: 2, 3: 3}[stage]
    return factor * (world_size - 1) / world_size * psi * elem_bytes


def fully_shard_state_bytes(psi, world_size, optimizer="adam", offload=False):
    """Bytes per rank of FullyShard's model states, split as it holds them.

    The shard the optimizer steps is the parameter: fp32 (the master under mixed precision,
    whose 2-byte copy exists only while a unit is gathered), its gradient the same dtype, and
    the optimizer's own state (Adam: momentum + variance): (4 + 4 + K_fp32)Ψ/N. With or
    without mixed precision that is the paper's stage-3 total, since its mixed-precision K
    counts the 4-byte master: 2 + 2 + (K_fp32 + 4) = 4 + 4 + K_fp32 (16Ψ/N for Adam).
    Offload moves all of it to the host: 0 on the device, `host` bytes there.
    """
    k = OPTIMIZER_K[(False, "adam" if optimizer in ("adam", "adamw") else optimizer)]
    out = dict(params=4 * psi / world_size, grads=4 * psi / world_size,
               optimizer=k * psi / world_size)
    if offload:
        return dict(params=0.0, grads=0.0, optimizer=0.0, host=sum(out.values()))
    return out


def state_bytes(psi, world_size, stage, optimizer="adam", mixed_precision=False, offload=False):
    """{params, grads, optimizer} bytes per rank: stages 1, 2 the ZeRO paper's split
    (`memory.model_state_bytes`); stage 3 FullyShard's (`fully_shard_state_bytes`, the same
    total, with `host` under offload)."""
    if stage == 3:
        return fully_shard_state_bytes(psi, world_size, optimizer, offload)
    out = model_state_bytes(psi, mixed_precision=mixed_precision, optimizer=optimizer,
                            zero_stage=stage, world_size=world_size)
    return {k: out[k] for k in ("params", "grads", "optimizer")}


def memory_per_rank(psi, world_size, stage, activations, unit_numels, optimizer="adam",
                    mixed_precision=False, offload=False):
    """Bytes per rank: `state_bytes`, `activations` (the fp32 bytes of global_batch/N examples;
    half of them in bf16) and stage 3's buffers: the two largest of `unit_numels` gathered at
    once (one computing, one prefetched). `peak` adds them (an upper bound)."""
    out = state_bytes(psi, world_size, stage, optimizer, mixed_precision, offload)
    out["activations"] = activations * (0.5 if mixed_precision else 1.0)
    largest = sorted(unit_numels)[-2:]
    w = 2 if mixed_precision else 4
    out["buffers"] = w * sum(largest) if stage == 3 and world_size > 1 else 0.0
    out["peak"] = sum(out[k] for k in ("params", "grads", "optimizer", "activations",
                                       "buffers"))
    return out
