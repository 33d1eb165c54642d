"""ShardedOptimizer (ZeRO stages 1 and 2) on models it was not written for, against one device.

Every configuration trains 3 steps on its rank's slice of the batch and must land within rounding
of a single-device run of the same torch optimizer on the whole batch (fp32; labkit.numerics: a
few times the float32 run's own error against the same run in float64). Stage 1 gets its
averaged gradients from an explicit all_reduce here; stage 2 reduce-scatters them itself. Also
measured on each rank: optimizer state bytes (from optimizer.state), gradient bytes left after
the step, the user's RNG state, the consolidated state dict against the single-device one, and
load_state_dict of a single-device state dict.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import numerics
from labkit.models import build
from labkit.parallel.zero import ShardedOptimizer
from labkit.runtime.memory import optimizer_state_tensors, storage_bytes
from spawn_helpers import spawn

STEPS, BATCH = 3, 8
MAX_NORM = 0.5       # gradient clipping (the GPT's and the tied model's first steps clip)
BUCKET_MB = dict(gpt=0.004)   # MB: a few buckets in each model (~100 bytes in the tiny ones)
SUB_GROUP_CONFIGS = [("gpt", "adamw_two_groups", 1), ("gpt", "adamw_two_groups", 2),
                     ("mlp_frozen_bias", "sgd", 2)]
MODELS = ("mlp_frozen_bias", "tied", "root_param", "gpt")
OPTIMIZERS = ("sgd", "adamw_two_groups")
CONFIGS = [(m, o, s) for m in MODELS for o in OPTIMIZERS for s in (1, 2)] \
    + [("mlp_frozen_bias", "adafactor", 1)]   # stage 1 steps whole tensors: a factored
#                                                optimizer works too (not on the GPT: see eps)


class TiedLM(nn.Module):
    """The output projection is the embedding matrix (one tensor used twice)."""

    def __init__(self, vocab=13, hidden=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.emb(idx))))


class RootParam(nn.Module):
    """A parameter that lives on the root module itself, beside a child layer."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 7))
        self.out = nn.Linear(7, 3)

    def forward(self, x):
        return self.out(x * self.scale)


def make_model(name):
    torch.manual_seed(0)
    if name == "mlp_frozen_bias":   # odd sizes: no flat bucket divides by 2 or 4 on its own
        model = nn.Sequential(nn.Linear(5, 11), nn.GELU(), nn.Linear(11, 9), nn.GELU(),
                              nn.Linear(9, 3))
        model[2].bias.requires_grad_(False)
        return model
    if name == "tied":
        return TiedLM()
    if name == "root_param":
        return RootParam()
    return build("gpt", vocab=32, seq=8, hidden=16, heads=2, layers=1, ffn=32)


def make_batch(name):
    g = torch.Generator().manual_seed(1)       # the test's own generator, not the global RNG
    if name in ("tied", "gpt"):
        vocab, seq = (13, 5) if name == "tied" else (32, 8)
        idx = torch.randint(0, vocab, (BATCH, seq + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]
    dims = (5, 3) if name == "mlp_frozen_bias" else (7, 3)
    return torch.randn(BATCH, dims[0], generator=g), torch.randn(BATCH, dims[1], generator=g)


def loss_of(name, model, x, y):
    if name == "gpt":
        return model(x, y)
    out = model(x)
    if name == "tied":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def optimizer_args(opt, model):
    """(class, params or param groups, defaults): AdamW with weight decay and two lrs."""
    params = list(model.parameters())
    if opt == "sgd":
        return torch.optim.SGD, params, dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    if opt == "adafactor":
        return torch.optim.Adafactor, params, dict(lr=1e-2)
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "lr": 3e-3}]
    # eps 1e-5: the GPT's attention key bias has a true gradient of 0 (softmax ignores a shift
    # of every score), so what it gets is rounding noise (~1e-11) that depends on the summation
    # order; Adam divides it by its own size into an lr-sized step (eps 1e-8: 5e-5 apart after
    # 3 steps). With 1e-5 the noise stays noise.
    return torch.optim.AdamW, groups, dict(lr=1e-3, weight_decay=0.1, eps=1e-5)


def reference(name, opt, dtype=torch.float32):
    """One device, the whole batch, the plain torch optimizer (float64: the exact run)."""
    model = make_model(name).to(dtype)
    cls, params, defaults = optimizer_args(opt, model)
    optimizer = cls(params, **defaults)
    x, y = numerics.cast(make_batch(name), dtype)
    norms = []
    for _ in range(STEPS):
        loss_of(name, model, x, y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, norms


def state_diff(a, b):
    """Largest difference between two optimizer state dicts (inf if their layouts differ)."""
    if a["state"].keys() != b["state"].keys():
        return float("inf")
    worst = 0.0
    for i, sa in a["state"].items():
        sb = b["state"][i]
        if sa.keys() != sb.keys():
            return float("inf")
        for k, va in sa.items():
            if torch.is_tensor(va):
                if va.shape != sb[k].shape:
                    return float("inf")
                worst = max(worst, (va.double() - sb[k].double()).abs().max().item())
    return worst


def state_tensors(state_dict):
    """{"parameter index/state name": tensor} of an optimizer state dict."""
    return {f"{i}/{k}": v for i, s in state_dict["state"].items() for k, v in s.items()
            if torch.is_tensor(v)}


def train_one(ctx, name, opt, stage, group):
    """Train with ShardedOptimizer on this rank's slice; what the assertions need."""
    g = ctx.group(group)
    model = make_model(name)
    cls, params, defaults = optimizer_args(opt, model)
    x, y = make_batch(name)
    per = BATCH // g.size
    xs, ys = x[g.rank * per:(g.rank + 1) * per], y[g.rank * per:(g.rank + 1) * per]
    trainable = [p for p in model.parameters() if p.requires_grad]
    ctx.comm.reset()
    rng = torch.get_rng_state()
    bucket_mb = BUCKET_MB.get(name, 1e-4)
    sharded = ShardedOptimizer(params, cls, group=group, stage=stage, bucket_mb=bucket_mb,
                               **defaults)
    norms = []
    for _ in range(STEPS):
        for half in (slice(0, per // 2), slice(per // 2, per)):  # accumulate two micro-batches
            (loss_of(name, model, xs[half], ys[half]) / 2).backward()
        if stage == 1:   # one flat all_reduce: what DataParallel would do, in buckets
            flat = ctx.comm.all_reduce(torch.cat([p.grad.reshape(-1) for p in trainable]),
                                       op="avg", group=group, tag="test grads")
            for p, grad in zip(trainable, flat.split([p.numel() for p in trainable])):
                p.grad.copy_(grad.view_as(p))
        norms.append(sharded.clip_grad_norm_(MAX_NORM).item())
        sharded.step()
        memory = ctx.memory.snapshot()          # after the step, before zero_grad
        full_grads = sum(p.grad is not None for p in trainable)
        sharded.zero_grad()
    rng_kept = torch.equal(rng, torch.get_rng_state())
    ref_model, ref_opt, ref_norms = reference(name, opt)
    exact_model, exact_opt, exact_norms = reference(name, opt, torch.float64)
    sharded.consolidate_state_dict(to=0)
    consolidated = sharded.state_dict() if g.rank == 0 else None
    loaded = []   # the same shard layout for both: float32 parameters (the exact state rounds)
    for o in (ref_opt, exact_opt):
        loaded.append(ShardedOptimizer(optimizer_args(opt, make_model(name))[1], cls,
                                       group=group, stage=stage, bucket_mb=bucket_mb, **defaults))
        loaded[-1].load_state_dict(o.state_dict())
    local = lambda o: dict(state=o.optim.state_dict()["state"])  # noqa: E731
    within = lambda mine, ref, exact: numerics.compare(   # noqa: E731
        state_tensors(mine), state_tensors(ref), state_tensors(exact))
    return dict(
        params=numerics.compare(dict(model.named_parameters()),
                                dict(ref_model.named_parameters()),
                                dict(exact_model.named_parameters())),
        norms=numerics.compare_loss(norms, ref_norms, exact_norms), ref_norms=ref_norms,
        rng_kept=rng_kept,
        state_bytes=storage_bytes(optimizer_state_tensors(sharded)),
        ref_state_bytes=storage_bytes(optimizer_state_tensors(ref_opt)),
        largest_param_state=max(storage_bytes(v for k, v in s.items() if k != "step")
                                for s in ref_opt.state.values()),
        state_per_element=storage_bytes(optimizer_state_tensors(ref_opt))
        / sum(p.numel() for p in trainable),
        buckets=len(sharded.buckets),
        grads=memory["grads"], full_grads_left=full_grads,
        shard_grad_bytes=sum(b.shard.numel() * b.shard.element_size() for b in sharded.buckets),
        consolidated_layout=None if consolidated is None else state_diff(
            consolidated, ref_opt.state_dict()) < float("inf"),
        consolidated=None if consolidated is None else within(
            consolidated, ref_opt.state_dict(), exact_opt.state_dict()),
        loaded_layout=state_diff(local(loaded[0]), local(sharded)) < float("inf"),
        loaded=within(local(sharded), local(loaded[0]), local(loaded[1])),
        ops={(r["op"], r["tag"].rstrip("0123456789 ")) for r in ctx.comm.summary(
            by=("op", "group", "tag")) if r["group"] == _name(g.ranks)})


def _name(ranks):
    return ",".join(map(str, ranks)) if len(ranks) <= 2 else f"{ranks[0]}-{ranks[-1]}"


def run_all(ctx, group=None, configs=CONFIGS):
    return {config: train_one(ctx, *config, group) for config in configs}


def check(results, size):
    """Assertions on one group's results (a list by group rank)."""
    for config in results[0]:
        name, opt, stage = config
        rows = [r[config] for r in results]
        where = f"{config} on {size} ranks"
        for r in rows:   # parameters, clipped norms and optimizer state: within rounding
            for key in ("params", "norms", "loaded"):
                assert r[key], (where, key, str(r[key]))
            assert r["loaded_layout"], where
        assert all(r["rng_kept"] for r in rows), f"{where}: the user's RNG state changed"
        assert rows[0]["consolidated_layout"], where
        assert rows[0]["consolidated"], (where, str(rows[0]["consolidated"]))
        state = [r["state_bytes"] for r in rows]
        total, per_element = rows[0]["ref_state_bytes"], rows[0]["state_per_element"]
        if stage == 1:   # whole tensors: every state byte once, balanced within one parameter
            assert sum(state) == total, where
            if opt != "adafactor":  # its state is not proportional to the parameter bytes
                assert max(state) - min(state) <= rows[0]["largest_param_state"], where
            assert rows[0]["full_grads_left"] > 0
            assert rows[0]["ops"] == {("all_reduce", "test grads"),
                                      ("broadcast", "params of rank"),
                                      ("all_gather", "optimizer state sizes"),
                                      ("all_gather", "optimizer state")}, where
        else:            # flat shards: equal, each ~1/N (padding: under N elements a bucket)
            assert len(set(state)) == 1 and state[0] > 0, where
            assert 0 <= size * state[0] - total < rows[0]["buckets"] * size * per_element, where
            assert rows[0]["buckets"] > 1, where    # several buckets: overlap is exercised
            assert all(r["full_grads_left"] == 0 for r in rows), where
            assert all(r["grads"] == r["shard_grad_bytes"] for r in rows), where
            assert rows[0]["ops"] == {("reduce_scatter", "grad bucket"),
                                      ("all_gather", "param bucket"),
                                      ("all_gather", "optimizer state sizes"),
                                      ("all_gather", "optimizer state"),
                                      ("all_reduce", "grad norm")}, where
    assert any(max(r[c]["ref_norms"]) > MAX_NORM for c in results[0] for r in results), \
        "clipping is exercised"


@pytest.mark.numerics
def test_matches_one_device_under_launch():
    check(labkit.launch(run_all, 2, timeout_s=300), 2)


def _spawned(rank, world_size):
    """A plain mp.spawn program: the world of 4, then the sub-groups {0,2} and {1,3} at once."""
    ctx = labkit.context()
    world = run_all(ctx)
    pair = ctx.split_groups([[0, 2], [1, 3]])
    return dict(world=world, pair=run_all(ctx, pair.pg, SUB_GROUP_CONFIGS), pair_ranks=pair.ranks)


def test_matches_one_device_in_a_spawned_program_and_a_sub_group():
    results = spawn(_spawned, 4)
    check([r["world"] for r in results], 4)
    assert results[1]["pair_ranks"] == (1, 3)
    check([results[1]["pair"], results[3]["pair"]], 2)
    check([results[0]["pair"], results[2]["pair"]], 2)


def test_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        ShardedOptimizer([torch.zeros(2, requires_grad=True)], torch.optim.SGD, stage=3, lr=1)
    with pytest.raises(ValueError, match="element-wise"):
        ShardedOptimizer([torch.zeros(2, requires_grad=True)], torch.optim.LBFGS, stage=2)
