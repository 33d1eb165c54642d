"""The degrees of a training mesh, checked before any group is made or any rank starts.

`validate_dims` is the one check of the degrees themselves (like torchtitan's
ParallelDims._validate); `check_layout` adds what a GPT of a given shape and batch can take
(CLI flag names). `dp_groups` / `dp_cp_group` are the groups that reduce gradients: context
parallelism (cp) splits the sequence, not the weights, so the cp ranks of a stage hold the same
weights as its dp ranks do and their gradients are reduced over dp x cp together (torchtitan's
"dp_cp" dimension; with ZeRO-3 FullyShard shards over dp_shard x cp); `ep_dp_cp_group` the
replicas of an expert, over dp x cp / ep ranks; `ep_shard_group` those of one dp_shard group
(HSDP: FullyShard shards an expert over dp_shard x cp / ep ranks, replicated across
dp_replicate). Each error is one line naming the argument.
"""
from .ring_attention import LAYOUTS

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _positive(name, value, flag=False):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{'--' if flag else ''}{name} must be a positive integer, "
                         f"got {value!r}")


def validate_dims(*, dp, tp, pp, ep=1, dp_replicate=1, zero_stage=0, sequence_parallel=False,
                  experts=0, world_size=None, cp=1, cp_layout="zigzag", seq=None):
    """A one-line ValueError naming the argument, before any group is made. `seq`: the
    sequence length, if known (cp must cut it into cp, zigzag 2 x cp, equal chunks)."""
    for name, value in dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep,
                            dp_replicate=dp_replicate).items():
        _positive(name, value)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if zero_stage == 2 and pp > 1:
        raise ValueError(f"zero_stage=2 with pp={pp} is not composed here (as the planner, "
                         "Megatron-LM and DeepSpeed refuse it): use zero_stage 1 or 3 with pp")
    if zero_stage == 2 and (ep > 1 or experts):
        raise ValueError(f"zero_stage=2 with experts (ep={ep}) is not composed here: an expert "
                         "no token reaches on one replica has no gradient, and the replicas' "
                         "bucket reduce-scatters would not line up")
    if dp % dp_replicate:
        raise ValueError(f"dp_replicate={dp_replicate} does not divide dp={dp} "
                         "(HSDP: dp = dp_replicate x dp_shard)")
    if dp_replicate > 1 and zero_stage != 3:
        raise ValueError(f"dp_replicate={dp_replicate} needs zero_stage=3 (HSDP shards within "
                         f"dp_shard; with zero_stage={zero_stage} every dp rank is a replica)")
    if zero_stage == 3 and ep > 1 and (dp // dp_replicate) % ep:
        raise ValueError(f"dp_replicate={dp_replicate} leaves dp_shard={dp // dp_replicate} "
                         f"ranks, not a multiple of ep={ep} (HSDP shards each expert within "
                         "one dp_shard group, which must hold whole EP groups)")
    if cp_layout not in LAYOUTS:
        raise ValueError(f"cp_layout must be one of {', '.join(LAYOUTS)}, got {cp_layout!r}")
    chunks = cp if cp_layout == "contiguous" else 2 * cp
    if cp > 1 and seq is not None and seq % chunks:
        raise ValueError(f"cp={cp} does not cut the sequence of {seq} tokens into {chunks} "
                         f"equal chunks (the {cp_layout} layout over {cp} ranks)")
    if world_size is not None and world_size != dp * tp * pp * cp:
        dims = "dp x tp x pp" + (" x cp" if cp > 1 else "")
        raise ValueError(f"world_size={world_size} but {dims} = {dp * tp * pp * cp}")


def check_layout(*, dp, tp, pp, ep=1, zero=0, schedule="1f1b", microbatches=4, virtual=1,
                 sequence_parallel=False, experts=0, layers, heads, ffn, vocab, seq,
                 global_batch, dp_replicate=1, cp=1, cp_layout="zigzag"):
    """One-line ValueError (CLI flag names) for a mesh layout a GPT of this shape or this batch
    cannot take, before any rank starts: TP must divide what it splits (with SP, this rank's
    seq / cp tokens), CP must cut the sequence, each pipeline stage needs a layer (the
    embeddings and the head are stages of their own), the batch must split into dp replicas x
    micro-batches, EP must divide the experts and DP."""
    for name, value in dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=dp_replicate,
                            microbatches=microbatches, virtual=virtual).items():
        _positive(name.replace("_", "-"), value, flag=True)
    if cp_layout not in LAYOUTS:
        raise ValueError(f"--cp-layout must be one of {', '.join(LAYOUTS)}, got {cp_layout!r}")
    chunks = cp if cp_layout == "contiguous" else 2 * cp
    if seq % chunks:
        raise ValueError(f"--cp {cp} does not cut the sequence of {seq} tokens into {chunks} "
                         f"equal chunks (--cp-layout {cp_layout})")
    validate_dims(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=dp_replicate,
                  zero_stage=zero, sequence_parallel=sequence_parallel, experts=experts,
                  cp_layout=cp_layout, seq=seq)
    if schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}")
    for name, size in dict(heads=heads, ffn=ffn, vocab=vocab,
                           **({"seq / cp": seq // cp} if sequence_parallel else {})).items():
        if size % tp:
            raise ValueError(f"TP degree {tp} does not divide {name}={size}")
    stages = pp * (virtual if schedule == "interleaved" else 1)
    if layers + 2 < stages:
        raise ValueError(f"{stages} pipeline stages need at least {stages - 2} GPT layers "
                         f"(the embeddings and the head are stages of their own): pass "
                         f"--layers {stages - 2}")
    if global_batch % (dp * microbatches):
        raise ValueError(f"global batch {global_batch} does not split into dp={dp} "
                         f"replicas x {microbatches} micro-batches")
    if schedule == "interleaved" and microbatches % pp:
        raise ValueError(f"the interleaved schedule needs micro-batches ({microbatches}) "
                         f"divisible by pp={pp}")
    if experts:
        if experts % ep or dp % ep:
            raise ValueError(f"--ep {ep} must divide --experts {experts} and --dp {dp} (expert "
                             "parallelism spreads the experts over data-parallel ranks)")
    elif ep > 1:
        raise ValueError("--ep needs a mixture of experts: add --experts N")


def _partition(mesh, key):
    """Rank lists of the mesh grouped by key(row) (a row: a rank's coordinates)."""
    groups = {}
    for row in mesh.table():
        groups.setdefault(key(row), []).append(row["rank"])
    return list(groups.values())


def dp_cp_group(mesh):
    """The ranks holding this rank's weights (same pp and tp; every dp and cp index): those
    whose gradients are averaged together. mesh["dp"] when cp = 1. Every rank calls it."""
    if mesh.sizes["cp"] == 1:
        return mesh["dp"]
    return mesh.ctx.split_groups(_partition(mesh, lambda row: (row["pp"], row["tp"])))


def ep_dp_cp_group(mesh):
    """The replicas of this rank's experts (same pp, tp and ep index; every dp // ep and cp
    index): dp x cp / ep ranks whose expert gradients are averaged together. Each cp rank
    routes its own sequence shard through its ep group's all-to-all (the ep group holds one
    cp index), so the cp ranks hold the same experts as the ep_dp ranks do (torchtitan
    averages expert gradients over the ranks holding the same experts likewise).
    mesh["ep_dp"] when cp = 1. Every rank calls it."""
    if mesh.sizes["cp"] == 1:
        return mesh["ep_dp"]
    return mesh.ctx.split_groups(_partition(mesh, lambda row: (row["pp"], row["tp"],
                                                               row["ep"])))


def dp_groups(mesh, dp_replicate):
    """(dp_shard, dp_replicate) groups of this rank for ZeRO-3: dp index i is replica i // S,
    shard member i % S (S = dp / dp_replicate: consecutive dp ranks shard together,
    torchtitan's order); the shard group spans every cp index too (dp_shard x cp: the cp
    ranks hold the same weights). dp_replicate None when 1. Every rank calls it."""
    size = mesh.sizes["dp"] // dp_replicate
    if dp_replicate == 1:
        return dp_cp_group(mesh), None
    shard = mesh.ctx.split_groups(_partition(
        mesh, lambda row: (row["pp"], row["tp"], row["dp"] // size)))
    replicate = mesh.ctx.split_groups(_partition(
        mesh, lambda row: (row["pp"], row["cp"], row["tp"], row["dp"] % size)))
    return shard, replicate


def ep_shard_group(mesh, dp_replicate):
    """The ranks ZeRO-3 shards this rank's experts over: its experts' replicas (same pp, tp
    and ep index) within its dp_shard group, dp_shard x cp / ep ranks (torchtitan's
    dp_shard_mod_ep; ep | dp_shard, so an EP group lies in one dp_shard group and the
    dp_replicate group averaging dense shards holds the same experts too). `ep_dp_cp_group`
    when dp_replicate = 1. Every rank calls it."""
    if dp_replicate == 1:
        return ep_dp_cp_group(mesh)
    size = mesh.sizes["dp"] // dp_replicate
    return mesh.ctx.split_groups(_partition(
        mesh, lambda row: (row["pp"], row["tp"], row["ep"], row["dp"] // size)))
