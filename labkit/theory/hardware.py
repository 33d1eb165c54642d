"""Hardware numbers from labkit/tables/hardware.csv (data/ links to it): GPUs, links, clusters.

A GPU does `flops(dtype)` FLOP/s at peak; a cluster's `mfu` (Cluster.compute_time) is the
constant-MFU rule, a stated assumption lessons compare against: the run clock and the modelled
step times compute at theory/step_rate.in_step_gemm_rate instead.
A link moves `bandwidth * efficiency` bytes/s per direction after `latency` seconds.
A GPU's `memory_bytes` is what the driver reports (H100: 81559 MiB = 85.5e9 bytes), so that
"fits" compares like with like; `mamf_*` the measured maximum achievable matmul FLOP/s (a
public microbenchmark, see the CSV), the ceiling of theory/kernels.py's GEMM efficiency;
`achievable` an optional override of that ceiling.
"""
from __future__ import annotations

import csv
import functools
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

# The tables ship inside the package (labkit/tables/, package data), so that any install finds
# them; the checkout's data/ folder links to them and holds the bench results (bench.csv).
TABLES = resources.files("labkit") / "tables"
HARDWARE_CSV = TABLES / "hardware.csv"
_CHECKOUT_DATA = Path(__file__).parents[2] / "data"
DATA_DIR = _CHECKOUT_DATA if (_CHECKOUT_DATA / "bench.csv").is_file() else TABLES


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float     # dense tensor-core bf16/fp16 FLOP/s
    fp32_flops: float     # dense non-tensor-core fp32 FLOP/s
    memory_bytes: float   # bytes the driver reports (nvidia-smi memory.total); 1 GB = 1e9 bytes
    memory_bw: float      # bytes/s
    link: str             # name of the default intra-node link
    achievable: float | None = None   # override of the MAMF ceiling (None: kernels.ceiling)
    fp8_flops: float | None = None    # dense fp8 tensor-core FLOP/s (None: no fp8 tensor cores)
    power_w: float | None = None      # board power (datasheet TDP)
    nvlink_domain: int = 8            # GPUs one NVLink/fabric domain joins (a node; NVL72: 72)
    mamf_bf16_flops: float | None = None  # measured maximum achievable matmul FLOP/s, bf16
    mamf_fp8_flops: float | None = None   # the same for fp8 (None: not measured)
    hbm_fraction: float | None = None     # achieved / memory_bw (None: kernels.HBM_FRACTION)

    def flops(self, dtype="bf16") -> float:
        """Peak FLOP/s for a dtype: a torch dtype or 'bf16'/'fp16'/'fp8'/'fp32'/'float32'."""
        s = str(dtype).lower().replace("torch.", "")
        if s in ("bf16", "bfloat16", "fp16", "float16", "half"):
            return self.bf16_flops
        if s in ("fp32", "float32", "float", "tf32"):
            return self.fp32_flops
        if s in ("fp8", "float8", "float8_e4m3fn", "float8_e5m2"):
            if not self.fp8_flops:
                raise ValueError(f"{self.name} has no fp8 tensor cores: use bf16")
            return self.fp8_flops
        raise ValueError(f"unknown dtype {dtype!r}: use 'bf16', 'fp16', 'fp8' or 'fp32'")


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float   # bytes/s, per direction, line rate
    latency: float     # seconds per message (alpha)
    efficiency: float  # achieved / peak bandwidth (modelling assumption)

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPU
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link | None = None
    mfu: float = 0.5   # the constant-MFU rule (compute_time): an assumption, not a measurement;
    # the lab's own model of compute inside a step is step_rate.in_step_gemm_rate

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link_for(self, ranks) -> Link:
        """The link a group of global ranks talks over: intra-node if all share a node."""
        if len({self.node_of(r) for r in ranks}) <= 1:
            return self.intra
        if self.inter is None:
            raise ValueError(f"cluster {self.name!r} has no inter-node link "
                             f"for ranks {list(ranks)}")
        return self.inter

    def compute_time(self, flops: float, dtype="fp32") -> float:
        """Seconds for `flops` at mfu * peak FLOP/s of one GPU: the constant-MFU rule, for
        comparison (the lab's modelled steps use step_rate.in_step_gemm_rate)."""
        return flops / (self.gpu.flops(dtype) * self.mfu)


# ---------------------------------------------------------------------------- loading the CSV

def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", str(name).lower())


@functools.lru_cache(maxsize=None)
def _rows() -> tuple:
    with HARDWARE_CSV.open(newline="") as f:
        return tuple(csv.DictReader(f))


def _memory_bytes(row) -> float:
    """The driver's figure (the '80 GB' H100 reports 81559 MiB = 85.5e9 bytes): what 'fits'
    must be judged against; the datasheet's GB (1e9 bytes) where no driver figure is known."""
    driver = row.get("memory_bytes_driver", "").strip()
    return float(driver) if driver else float(row["memory_gb"]) * 1e9


def _optional(text):
    return float(text) if text and text.strip() else None


@functools.lru_cache(maxsize=None)
def _gpus() -> dict:
    out = {}
    for r in _rows():
        if r["kind"] == "gpu":
            out[r["name"]] = GPU(
                name=r["name"],
                bf16_flops=float(r["bf16_tflops"]) * 1e12,
                fp32_flops=float(r["fp32_tflops"]) * 1e12,
                memory_bytes=_memory_bytes(r),
                memory_bw=float(r["memory_bw_tbs"]) * 1e12,
                link=r["link"],
                achievable=_optional(r.get("achievable")),
                fp8_flops=(_optional(r.get("fp8_tflops")) or 0) * 1e12 or None,
                power_w=_optional(r.get("power_w")),
                nvlink_domain=int(_optional(r.get("nvlink_domain")) or 8),
                mamf_bf16_flops=(_optional(r.get("mamf_bf16_tflops")) or 0) * 1e12 or None,
                mamf_fp8_flops=(_optional(r.get("mamf_fp8_tflops")) or 0) * 1e12 or None,
            )
    return out


@functools.lru_cache(maxsize=None)
def _links() -> dict:
    out = {}
    for r in _rows():
        if r["kind"] == "link":
            out[r["name"]] = Link(
                name=r["name"],
                bandwidth=float(r["bandwidth_gbs"]) * 1e9,
                latency=float(r["latency_us"]) / 1e6,
                efficiency=float(r["efficiency"]),
            )
    return out


def table():
    """The hardware CSV as a DataFrame (GPUs and links, with their sources)."""
    import pandas as pd   # here, not at import: `plan` and `memory` answer without pandas
    with HARDWARE_CSV.open() as f:
        return pd.read_csv(f)


def gpus() -> list[GPU]:
    return list(_gpus().values())


def links() -> list[Link]:
    return list(_links().values())


# ---------------------------------------------------------------------------- lenient lookup

_GPU_ALIASES = {  # normalised alias -> canonical name ('H100' means the SXM part)
    "h100": "H100 SXM", "h200": "H200 SXM", "a100": "A100 SXM 80GB", "a100sxm": "A100 SXM 80GB",
    "a10080gb": "A100 SXM 80GB", "a10040gb": "A100 SXM 40GB", "4090": "RTX 4090",
    "geforcertx4090": "RTX 4090", "v100": "V100 SXM2 32GB", "v100sxm2": "V100 SXM2 32GB",
    "v10032gb": "V100 SXM2 32GB", "h100nvl": "H100 NVL", "h10096gb": "H100 NVL",
    "h100sxm5": "H100 SXM", "b200sxm": "B200", "gb200nvl72": "GB200", "mi300": "MI300X",
    "amdmi300x": "MI300X", "instinctmi300x": "MI300X",
}

_LINK_ALIASES = {  # normalised alias -> canonical name
    "nvlink": "NVLink 4", "ib": "InfiniBand NDR", "infiniband": "InfiniBand NDR",
    "ndr": "InfiniBand NDR", "hdr": "InfiniBand HDR", "pcie": "PCIe 5 x16",
}


def gpu(name) -> GPU:
    """Look up a GPU: 'H100', 'h100-sxm', 'H100 SXM', 'a100-40gb', 'rtx4090' ..."""
    if isinstance(name, GPU):
        return name
    table_ = {_norm(k): v for k, v in _gpus().items()}
    key = _norm(name).removeprefix("nvidia")
    key = _norm(_GPU_ALIASES.get(key, key))
    if key in table_:
        return table_[key]
    raise KeyError(f"unknown GPU {name!r}; known: {', '.join(_gpus())}")


def custom_gpu(peak_tflops, hbm_gb, hbm_tbps, link_name="NVLink 4", fp8_tflops=None,
               name="custom GPU") -> GPU:
    """A GPU that is not in the catalog, from its datasheet: dense bf16 TFLOP/s, HBM in GB,
    HBM bandwidth in TB/s (and optionally dense fp8 TFLOP/s and the intra-node link)."""
    for option, value in (("--gpu-peak-tflops", peak_tflops), ("--gpu-hbm-gb", hbm_gb),
                          ("--gpu-hbm-tbps", hbm_tbps)):
        if not isinstance(value, (int, float)) or not 0 < value < 1e7:
            raise ValueError(f"{option} must be a positive number, got {value!r}")
    link(link_name)   # an unknown link name ends here
    return GPU(name=name, bf16_flops=peak_tflops * 1e12, fp32_flops=peak_tflops * 1e12 / 16,
               memory_bytes=hbm_gb * 1e9, memory_bw=hbm_tbps * 1e12, link=link_name,
               fp8_flops=fp8_tflops * 1e12 if fp8_tflops else None)


def _link_key(name: str) -> str:
    key = _norm(name).replace("infiniband", "ib").removesuffix("x16")
    return key.removeprefix("ib") if key in ("ibndr", "ibhdr") else key


def link(name) -> Link:
    """Look up a link: 'NVLink4', 'nvlink-4', 'IB-NDR', 'NDR', 'ib', 'PCIe5', 'pcie-4-x16' ..."""
    if isinstance(name, Link):
        return name
    table_ = {_link_key(k): v for k, v in _links().items()}
    key = _link_key(name)
    key = _link_key(_LINK_ALIASES.get(key, key))
    if key in table_:
        return table_[key]
    raise KeyError(f"unknown link {name!r}; known: {', '.join(_links())} (or 'ib', 'ndr', 'hdr')")


def _pcie_for(g: GPU) -> Link:
    if g.link.lower().startswith("pcie"):
        return link(g.link)
    return link("PCIe 4") if g.link == "NVLink 3" else link("PCIe 5")


def _is_gpu(name: str) -> bool:
    try:
        gpu(name)
        return True
    except KeyError:
        return False


_CLUSTER_RE = re.compile(r"^(?:(\d+)x)?(\d+)x(.+)$", re.IGNORECASE)


def cluster(name, mfu: float = 0.5) -> Cluster:
    """Parse a cluster name: '[NODESx]GPUSxGPU[-INTRA][-IB|-NDR|-HDR]'.

    Examples: '8xH100-NVLink' (1 node, NVLink 4), '2x8xH100-IB' (2 nodes of 8, NVLink inside,
    InfiniBand NDR between), '2xRTX4090-PCIe', '4x8xA100-IB-HDR'. Without an intra-node word the
    GPU's default link is used; several nodes without an inter-node word get InfiniBand NDR.
    A Cluster instance is returned as is.
    """
    if isinstance(name, Cluster):
        return name
    m = _CLUSTER_RE.match(str(name).strip())
    if not m:
        raise ValueError(f"cannot parse cluster {name!r}; expected e.g. '8xH100-NVLink', "
                         "'2x8xH100-IB', '1xRTX4090'")
    nodes = int(m.group(1)) if m.group(1) else 1
    per_node = int(m.group(2))
    tokens = [t for t in m.group(3).split("-") if t]
    # Peel link words off the end until what is left names a GPU ('H100-PCIe' is a GPU).
    intra_word, inter_words = None, []
    while tokens and not _is_gpu("-".join(tokens)):
        t = _norm(tokens[-1])
        if t in ("ib", "infiniband", "ndr", "hdr"):
            inter_words.insert(0, t)
        elif t.startswith("nvlink") or t.startswith("pcie"):
            intra_word = t
        else:
            break
        tokens.pop()
    if not tokens:
        raise ValueError(f"cannot parse cluster {name!r}: no GPU name")
    try:
        g = gpu("-".join(tokens))
    except KeyError as e:
        raise ValueError(f"cannot parse cluster {name!r}: {e.args[0]}") from None

    if intra_word is None:
        intra = link(g.link)
    elif intra_word == "nvlink":
        if not g.link.startswith("NVLink"):
            raise ValueError(f"cluster {name!r}: {g.name} has no NVLink (its link is {g.link})")
        intra = link(g.link)
    elif intra_word == "pcie":
        intra = _pcie_for(g)
    else:
        try:
            intra = link(intra_word)
        except KeyError as e:
            raise ValueError(f"cannot parse cluster {name!r}: {e.args[0]}") from None

    inter = None
    if "hdr" in inter_words:
        inter = link("InfiniBand HDR")
    elif inter_words or nodes > 1:
        inter = link("InfiniBand NDR")
    return Cluster(name=str(name), gpu=g, gpus_per_node=per_node, nodes=nodes,
                   intra=intra, inter=inter, mfu=mfu)
