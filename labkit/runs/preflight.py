"""Checks made before any rank starts: options no run can take, and runs that cannot fit here.

A run's ranks all live on this machine, so what they need together must be available now.
Each rank's bytes are estimated with theory/'s formulas applied to the tiny shape under the
technique's layout, as a lower bound (a run refused here could never have fitted; the
formulas and their papers: theory/rank_memory.py):

    need = max(world_size x per rank, the single-device reference)

per rank: 4Ψ (the whole fp32 model, built before a rank keeps its shard) or its model states
and activations, whichever is more, plus a CPU rank's Python + torch + gloo
(`BYTES_PER_CPU_RANK`). The reference runs in the launching process after the ranks have
ended, so it needs its bytes alone.
"""
import math

from ..runtime.cpus import BYTES_PER_CPU_RANK, available_memory
from ..theory import rank_memory

VIRTUAL_SCHEDULES = ("interleaved",)   # the schedules that run more than one stage per rank


def check_run(technique, cfg, world_size, options, explicit=(), available=None):
    """One-line ValueError for bad options or a run that cannot fit; None when it may start.

    options: the technique's keyword options (as `report` takes them); explicit: the option
    names the user gave (a default left alone is never refused); available: bytes (default:
    what the system says now).
    """
    check_options(technique, cfg, options, explicit)
    check_fits(technique, cfg, world_size, options, available)


def check_options(technique, cfg, options, explicit=()):
    """Numbers that would make every rank raise, or be silently ignored, end here."""
    if not (isinstance(cfg.lr, (int, float)) and math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ValueError(f"--lr must be a positive finite number, got {cfg.lr}")
    bucket = options.get("bucket_mb")
    if bucket is not None and not (math.isfinite(bucket) and bucket > 0):
        raise ValueError(f"--bucket-mb must be a positive number of megabytes, got {bucket}")
    for name in ("ep", "experts", "microbatches", "virtual", "accumulate", "stage_count"):
        value = options.get(name)
        if value is not None and value < (0 if name == "experts" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                             f"got {value}")
    capacity = options.get("capacity_factor")
    if capacity is not None and not (math.isfinite(capacity) and capacity > 0):
        raise ValueError(f"--capacity-factor must be a positive number, got {capacity}")
    schedule = options.get("schedule")
    if "virtual" in explicit and schedule is not None and schedule not in VIRTUAL_SCHEDULES:
        raise ValueError(f"--virtual sets the stages per rank of the interleaved schedule; "
                         f"{schedule} runs one stage per rank: pass --schedule interleaved "
                         f"or drop --virtual")


def check_fits(technique, cfg, world_size, options, available=None):
    """Refuse, in one line, a run whose ranks (or reference) need more than is available."""
    available = available_memory() if available is None else available
    if available is None:   # the system does not say: nothing to compare with
        return
    try:
        need = estimate(technique, cfg, world_size, options)
        total = max(need["ranks"] * need["per_rank"], need["reference"])
        if total <= available:
            return
    except OverflowError:   # a shape so large its bytes do not fit in a float
        raise ValueError(f"run {technique}: the model's shape is too large for any memory "
                         f"({_shape(cfg)}); {_gb(available)} available") from None
    if need["ranks"] * need["per_rank"] >= need["reference"]:
        what = (f"{need['ranks']} rank(s) x {_gb(need['per_rank'])} ({need['why']}, + "
                f"{_gb(BYTES_PER_CPU_RANK)} per process)")
    else:
        what = "the single-device reference run in this process"
    raise ValueError(f"run {technique} needs about {_gb(total)} but {_gb(available)} is "
                     f"available: {what}; {_shape(cfg)}: choose a smaller shape or fewer ranks")


def estimate(technique, cfg, world_size, options):
    """{"ranks", "per_rank", "reference", "why"}: a lower bound of the bytes, see the docstring
    (the arithmetic: theory/rank_memory.py, on the numbers of the model `cfg` trains)."""
    return rank_memory.run_bytes(technique, world_size, options, _shape_numbers(cfg, options),
                                 gpt=cfg.model == "gpt", optimizer=cfg.optimizer,
                                 global_batch=cfg.global_batch, overhead=BYTES_PER_CPU_RANK)


def _shape_numbers(cfg, options):
    """(layers, seq, hidden, heads, vocab, parameters) of the model the run trains."""
    from .. import models
    if cfg.model != "gpt":
        dims = models.MLP().dims if not cfg.model_kwargs.get("dims") else cfg.model_kwargs["dims"]
        n = sum(a * b + b for a, b in zip(dims, dims[1:]))
        return len(dims) - 1, 1, max(dims), 1, 0, n
    c = models.GPTConfig(**cfg.model_kwargs)
    n = c.param_count()
    experts = options.get("experts") or 0
    if experts > 1:   # every MoE layer holds `experts` MLPs where the dense GPT has one
        n += (experts - 1) * c.layers * (2 * c.hidden * c.ffn + c.ffn + c.hidden)
    return c.layers, c.seq, c.hidden, c.heads, c.vocab, n


def _shape(cfg):
    if cfg.model != "gpt":
        return f"the {cfg.model}"
    from .. import models
    c = models.GPTConfig(**cfg.model_kwargs)
    return "GPT " + " ".join(f"{k}={_count(getattr(c, k))}"
                             for k in ("layers", "hidden", "heads", "ffn", "seq", "vocab"))


def _count(n):
    return str(n) if n < 10 ** 7 else f"~10^{len(str(n)) - 1}"


def _gb(n):
    try:
        return f"{n / 1e9:.1f} GB" if n < 1e12 else f"{n / 1e12:.3g} TB"
    except OverflowError:
        return "more bytes than a float holds"
