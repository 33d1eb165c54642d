"""How the virtual clock's time stamps ride inside collectives and messages (for comm.py).

A collective starts, on the modelled cluster, when its last member reaches it, so each member
must learn every member's modelled time; a message arrives at its sender's time plus transfer.
Rather than a second round of communication per op, the stamp (a float64 of modelled seconds)
travels with the op's own data:
- ops that move bytes unchanged (all_gather, all_to_all, send) carry it as 8 more bytes;
- reductions (all_reduce, reduce_scatter) carry one slot per member, zero except the member's
  own, which holds the stamp's 64 bits cut into small non-negative integers that the payload's
  dtype represents exactly (16 bits each in fp32, 8 in bf16 and fp16). Adding zeros (or taking
  a max against zeros, a min against all-ones) leaves every slot exact, so every member reads
  every stamp back bit for bit and takes the largest.
"""
import struct

import torch

# Bits of the stamp per slot element, for each dtype a reduction can carry them in.
_CHUNK_BITS = {torch.float64: 32, torch.int64: 32, torch.float32: 16, torch.int32: 16,
               torch.bfloat16: 8, torch.float16: 8, torch.int16: 8, torch.uint8: 8,
               torch.int8: 4}


def needed(timing):
    """Whether the op must exchange stamps (clock on, a group of more than one rank)."""
    return timing is not None and timing.group_ready is None


def reduction_slots(dtype, op, group, timing, device=None):
    """This member's slots for a reduction of `dtype` (None: no stamps, or a dtype that cannot
    carry them: then comm exchanges them apart)."""
    bits = _CHUNK_BITS.get(dtype)
    if bits is None or not needed(timing):
        return None
    per_rank, mask = 64 // bits, (1 << bits) - 1
    (word,) = struct.unpack("<Q", struct.pack("<d", timing.issued))
    values = [mask if op == "min" else 0] * (group.size * per_rank)
    values[group.rank * per_rank:(group.rank + 1) * per_rank] = [
        (word >> (bits * i)) & mask for i in range(per_rank)]
    return torch.tensor(values, dtype=dtype, device=device)


def read_slots(slots, dtype):
    """The largest stamp in reduced slots (one group of chunks per member)."""
    bits = _CHUNK_BITS[dtype]
    per_rank = 64 // bits
    values = [int(v) for v in slots.tolist()]
    latest = None
    for start in range(0, len(values), per_rank):
        word = 0
        for i, v in enumerate(values[start:start + per_rank]):
            word |= v << (bits * i)
        (stamp,) = struct.unpack("<d", struct.pack("<Q", word))
        latest = stamp if latest is None else max(latest, stamp)
    return latest


def with_slots(tensor, slots, pieces=1):
    """`tensor` cut into `pieces` equal pieces, each followed by the slots, as one flat tensor
    (all_reduce: one piece; reduce_scatter: one per member, so that each gets every stamp)."""
    return torch.cat((tensor.reshape(pieces, -1), slots.expand(pieces, -1)), dim=1).reshape(-1)


def unpack_reduced(received, out, divide_by=1):
    """Copy the reduced data into `out` (divided, for an average); the latest stamp."""
    data = received[:out.numel()].view(out.shape)
    if divide_by != 1:
        torch.div(data, divide_by, out=out)
    else:
        out.copy_(data)
    return read_slots(received[out.numel():], out.dtype)


def stamp_bytes(timing, like):
    """The 8 bytes of this rank's stamp (0.0 with the clock off), on `like`'s device."""
    value = timing.issued if timing is not None else 0.0
    return torch.tensor([value], dtype=torch.float64, device=like.device).view(torch.uint8)


def read_bytes(raw):
    """The largest stamp among raw 8-byte stamps (any shape with 8 * k bytes)."""
    return max(raw.reshape(-1).clone().view(torch.float64).tolist())


def as_bytes(tensor):
    """A contiguous tensor's bytes, as a flat uint8 view of the same memory."""
    return tensor.reshape(-1).view(torch.uint8)


def with_stamp(tensor, timing, byte_splits=None):
    """`tensor`'s bytes (cut into pieces of `byte_splits` bytes), each piece followed by this
    rank's 8-byte stamp: what a message, an all_gather or an all_to_all sends."""
    data, stamp = as_bytes(tensor.contiguous()), stamp_bytes(timing, tensor)
    if byte_splits is None:
        return torch.cat((data, stamp))
    return torch.cat([x for piece in data.split(byte_splits) for x in (piece, stamp)])


def unpack(received, out, byte_splits=None):
    """Copy the data pieces of `received` (each followed by a stamp) into `out`, in order;
    return the latest of the stamps."""
    byte_splits = [out.nbytes] if byte_splits is None else byte_splits
    parts = received.split([b for size in byte_splits for b in (size, 8)])
    target = out if out.is_contiguous() else torch.empty_like(
        out, memory_format=torch.contiguous_format)
    torch.cat(parts[0::2], out=as_bytes(target))
    if target is not out:
        out.copy_(target)
    return read_bytes(torch.cat(parts[1::2]))


def equal_splits(splits, rows, n):
    """`splits` (rows per member), or `rows` cut into n equal parts."""
    if splits is not None:
        return list(splits)
    if rows % n:
        raise ValueError(f"all_to_all: dim 0 ({rows}) must divide by the group size ({n}) "
                         f"when no splits are given")
    return [rows // n] * n
