"""A measured hardware profile (`python -m labkit calibrate` writes it): its format, its loader,
and the catalog GPU with the measured numbers in place of the datasheet's.

The planners model a step from datasheet constants (labkit/tables/hardware.csv): peak dense bf16
FLOP/s times the MAMF ceiling and each kernel's shape efficiency (theory/kernels.py), and HBM
bytes/s times an achievable fraction. A profile replaces both with what one machine measured:
the peak by the best large bf16 GEMM (which is what the catalog's MAMF column, "maximum
achievable matmul FLOP/s", means: the ceiling becomes 1, the shape efficiencies stay), the
bandwidth by a device-to-device copy (its achievable fraction becomes 1).

The format (JSON; every time in seconds, every rate as named):
    {"gpu": str, "torch": str, "cuda": str|null,
     "gemm": [{"m", "n", "k": int, "dtype": str, "tflops": float}, ...],   (at least one)
     "hbm_gbps": float,          (GB/s = 1e9 bytes/s, read + write bytes counted)
     "decode_step_s": [{"model": str, "batch": int, "context": int, "seconds": float}],
     "train_step_s": [{"model": str, "batch": int, "seq": int, "seconds": float}],
     "all_reduce": [{"bytes": int, "seconds": float}]}      (empty on one GPU)
This module imports no torch (`plan` stays quick).
"""
from __future__ import annotations

import dataclasses
import unicodedata

from . import hardware
from .user_files import parse_user_json, read_user_text

LISTS = {"gemm": {"m": int, "n": int, "k": int, "dtype": str, "tflops": float},
         "decode_step_s": {"model": str, "batch": int, "context": int, "seconds": float},
         "train_step_s": {"model": str, "batch": int, "seq": int, "seconds": float},
         "all_reduce": {"bytes": int, "seconds": float}}
LARGE_GEMM = 4096   # a GEMM counts toward the peak when m, n and k are all at least this
# What a measurement can be, so that a typo or a forged file cannot plan a 1e303 s step. GEMM:
# a batch-1 GEMV on a V100 runs ~0.3 TFLOP/s; the fastest catalog GPU (GB200, 2,500 dense bf16,
# its datasheet in labkit/tables/hardware.csv) is 40x below the top. HBM: the catalog spans
# 900 GB/s (V100) to 8,000 GB/s (B200). Times: nothing on a GPU ends in under 100 ns (a kernel
# launch takes microseconds), and calibrate measures nothing that takes a day.
BOUNDS = {"tflops": (0.01, 100_000.0, "TFLOP/s"), "hbm_gbps": (10.0, 100_000.0, "GB/s"),
          "seconds": (1e-7, 86_400.0, "s")}
MAX_INT = 2 ** 40      # shapes, batches and bytes: beyond it a field is a typo
MAX_BYTES = 1 << 20    # a profile is a few kilobytes
MAX_NAME = 200         # characters of the "gpu" and "torch" strings


def check_profile(data, where="profile"):
    """The profile dict itself if it has the format above; else ValueError in one line."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a profile is a JSON object, got {type(data).__name__}")
    for key in ("gpu", "torch"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"{where}: '{key}' must be a string, got {data.get(key)!r}")
        if not 0 < len(data[key]) <= MAX_NAME:
            raise ValueError(f"{where}: '{key}' must be 1 to {MAX_NAME} characters, got "
                             f"{len(data[key])}")
    _positive(data.get("hbm_gbps"), f"{where}: 'hbm_gbps'", BOUNDS["hbm_gbps"])
    for key, fields in LISTS.items():
        rows = data.get(key)
        if not isinstance(rows, list):
            raise ValueError(f"{where}: '{key}' must be a list, got {type(rows).__name__}")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ValueError(f"{where}: {key}[{i}] must be an object, got {row!r}")
            for name, kind in fields.items():
                value = row.get(name)
                label = f"{where}: {key}[{i}].{name}"
                if kind is str:
                    if not isinstance(value, str):
                        raise ValueError(f"{label} must be a string, got {value!r}")
                elif kind is int:
                    if not isinstance(value, int) or isinstance(value, bool) or \
                            not 1 <= value <= MAX_INT:
                        raise ValueError(f"{label} must be a positive integer (at most "
                                         f"2^40), got {value!r}")
                else:
                    _positive(value, label, BOUNDS[name])
    if not data["gemm"]:
        raise ValueError(f"{where}: 'gemm' has no measurement")
    return data


def _positive(value, label, bounds):
    low, high, unit = bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not low <= value <= high:
        raise ValueError(f"{label} must be a positive number, {low:g} to {high:,g} {unit} "
                         f"(what a GPU can measure), got {value!r}")


def printable(text):
    """`text` with its control and format characters escaped (\\n, \\x1b, \\u202e): a
    name read from a file can then neither forge a line of output nor move the terminal."""
    return "".join(c.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")
                   else c for c in text)


def load_profile(path):
    """Read and check a profile file; a missing, unreadable, non-regular (a FIFO would block
    forever), oversized, non-UTF-8, too deeply nested or malformed one: one-line ValueError
    naming the file and what is wrong. Its "gpu" and "torch" names come back printable."""
    where = f"--gpu-profile {printable(str(path))}"
    text = read_user_text(path, where, MAX_BYTES,
                          "give the UTF-8 JSON file that `calibrate --out` wrote")
    data = parse_user_json(text, where, "a profile")
    check_profile(data, where=where)
    return dict(data, gpu=printable(data["gpu"]), torch=printable(data["torch"]))


def peak_tflops(profile):
    """The best bf16 GEMM TFLOP/s among the large ones (all dims >= LARGE_GEMM), else the best
    bf16 GEMM measured."""
    bf16 = [g for g in profile["gemm"] if g["dtype"] in ("bf16", "bfloat16")]
    if not bf16:
        raise ValueError("the profile has no bf16 GEMM to take the peak from")
    large = [g for g in bf16 if min(g["m"], g["n"], g["k"]) >= LARGE_GEMM]
    return max(g["tflops"] for g in (large or bf16))


def catalog_gpu(name):
    """The catalog GPU a device name (torch.cuda.get_device_name: 'NVIDIA H200') stands for,
    or None: tried whole, then by the first word that names a catalog GPU."""
    for candidate in [name] + str(name).replace("-", " ").split():
        try:
            return hardware.gpu(candidate)
        except KeyError:
            continue
    return None


def profiled_gpu(profile, gpu=None):
    """`gpu` (a catalog name or GPU; default: the profile's own GPU) with the profile's
    measured peak bf16 FLOP/s (also as its MAMF) and HBM bandwidth in place of the catalog's."""
    base = hardware.gpu(gpu) if gpu is not None else catalog_gpu(profile["gpu"])
    if base is None:
        raise ValueError(f"the profile's GPU '{printable(profile['gpu'])}' is not in the "
                         "catalog: give --gpu too")
    peak = peak_tflops(profile) * 1e12
    return dataclasses.replace(base, name=f"{base.name} (measured: {printable(profile['gpu'])})",
                               bf16_flops=peak, mamf_bf16_flops=peak,
                               memory_bw=profile["hbm_gbps"] * 1e9, hbm_fraction=1.0)


def plan_gpu(path, gpu=None):
    """`plan --gpu-profile PATH`: (the profiled GPU, the plan's first line saying so)."""
    measured = load_profile(path)
    g = profiled_gpu(measured, gpu)
    return g, (f"GPU numbers from the profile {printable(str(path))} (measured on "
               f"{printable(measured['gpu'])}): peak bf16 {g.bf16_flops / 1e12:.1f} TFLOP/s "
               f"(best large GEMM), HBM {g.memory_bw / 1e9:.0f} GB/s; the rest: the catalog's "
               f"{g.name.split(' (measured')[0]}; MFU below is of the measured peak")
