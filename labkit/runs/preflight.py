"""Checks made before any rank starts: options no run can take, and runs that cannot fit here.

A run's ranks all live on this machine, so what they need together must be available now.
Each rank's bytes are estimated with theory/'s formulas applied to the tiny shape under the
technique's layout, as a lower bound (a run refused here could never have fitted):

    per rank  = max(4Ψ, states(Ψ / shards, ZeRO) + activations(the rank's slice)) + overhead
    parent    = states(Ψ) + activations(global batch)       (the single-device reference)
    need      = max(world_size x per rank, parent)

4Ψ: every driver builds the whole fp32 model on every rank before it keeps its shard. States:
fp32 weights, grads and optimizer (ZeRO, arXiv 1910.02054); activations: what the tiny GPT
saves for backward (Korthikanti et al. 2022, arXiv 2205.05198, `tiny_gpt_activation_bytes`);
overhead: a CPU rank's Python + torch + gloo (`BYTES_PER_CPU_RANK`). The reference runs in the
launching process after the ranks have ended, so it needs its bytes alone.
"""
import math

from ..runtime.cpus import BYTES_PER_CPU_RANK, available_memory
from ..theory import context_parallel as theory_cp
from ..theory import memory as tm

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
    """{"ranks", "per_rank", "reference", "why"}: a lower bound of the bytes, see the docstring."""
    o = options
    world = world_size or 1
    layers, seq, hidden, heads, vocab, n = _shape_numbers(cfg, o)
    shards, zero, batch, cp = 1, 0, cfg.global_batch, 1
    pipeline_stages, tp = 1, 1
    if technique == "hybrid":
        dp, tp, pp = o.get("dp", 2), o.get("tp", 2), o.get("pp", 2)
        world, shards, zero, pipeline_stages = dp * tp * pp, tp * pp, o.get("zero", 0), pp
        batch = cfg.global_batch / (dp * o.get("microbatches", 2))
    elif technique == "tp":
        shards, tp = world, world
    elif technique == "pipeline":
        shards = pipeline_stages = world
        batch = cfg.global_batch / (1 if o.get("schedule") == "naive"
                                    else o.get("microbatches", 4))
    elif technique == "cp":
        cp = world
    elif technique == "zero":
        zero, batch = min(o.get("stage", 1), 3), cfg.global_batch / world
    elif technique in ("dp", "moe"):
        batch = cfg.global_batch / world
    states = _states(n / shards, cfg.optimizer, zero, world if technique == "zero" else
                     o.get("dp", world) if technique == "hybrid" else 1)
    activations = _activations(cfg, layers / pipeline_stages, seq, batch, hidden, heads, vocab,
                               tp, cp)
    per_rank = max(4 * n, states + activations) + BYTES_PER_CPU_RANK
    reference = _states(n, cfg.optimizer, 0, 1) + _activations(
        cfg, layers, seq, cfg.global_batch, hidden, heads, vocab, 1, 1)
    why = (f"the whole model, {n:.3g} parameters, is built on every rank" if 4 * n >=
           states + activations else "model states and activations of its share")
    return dict(ranks=world, per_rank=per_rank, reference=reference, why=why)


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


def _states(params, optimizer, zero_stage, dp):
    out = tm.model_state_bytes(params, mixed_precision=False, optimizer=optimizer,
                               zero_stage=zero_stage, world_size=dp)
    return out["total"]


def _activations(cfg, layers, seq, batch, hidden, heads, vocab, tp, cp):
    """Bytes one rank saves for backward: its layers, its sequence slice, its heads."""
    if cfg.model != "gpt":
        return 4 * batch * hidden * 2 * layers
    if cp > 1:   # ring attention keeps each K/V block's scores: the attention term of theory/
        head_dim = hidden // heads
        attention = theory_cp.attention_saved_bytes(batch, heads, seq, head_dim, cp,
                                                     dtype_bytes=4)
        block = 4 * batch * heads * (seq / cp) ** 2   # one block's scores, made at a time
        return layers * (16 * seq / cp * batch * hidden * 4 + attention) + block
    return tm.tiny_gpt_activation_bytes(layers=layers, seq=seq, batch=batch, hidden=hidden / tp,
                                        heads=heads / tp, vocab=vocab / tp)


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
