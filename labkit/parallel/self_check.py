"""Every building block checks itself on the model it is given, before the first real step.

`check_against_one_device(model, apply, group)` builds a miniature of the same module class (a
Hugging Face model's own config shrunk: 2 layers, heads of 16 features, 2 x the group's size
of them, a small vocabulary and MLP; any other module: a copy of itself), gives every parameter
that starts constant (norm weights, biases) some noise, so that a mix-up between heads or
features shows, and runs one forward and backward on random tokens three times: as built
(float32), in float64 (the exact run) and through `apply` (the block, on the same group). It
refuses in one line if anything differs beyond labkit.numerics' rule (rms error within 4x
float32's own), naming where it starts: the first submodule whose output differs (in the order
they ran; outputs shaped as on one device), else the output, else the parameter whose gradient
goes wrong first (a wrong gradient spreads upstream: the first failing parameter of the last
layer with a failure). A plan that would train wrong never reaches the first step. Each rank
judges its own gradients (under TP a replicated parameter's gradient is this rank's copy, so
ranks that disagree fail) and the worst verdict over the group is everyone's: all ranks raise
together, no rank is left waiting in a collective. The check runs off the record (no comm log,
no clock, the memory tracker as it was) and leaves the caller's random state as it was.

Any block calls it with its own `apply` (split, shard, wrap the miniature: return the module to
run), `forward` (module, ids) -> output and `gradients` (module) -> {name: whole gradient}
under the model's own parameter names; a block whose ranks each take a share of the batch
(FullyShard, fully_shard, ExpertParallel) runs it through `batch_share_forward`, its output
gathered and each rank's loss the mean over its own rows (`own_mean`, as data parallelism
averages). Callers: parallelize_module, FullyShard, fully_shard, ContextParallel,
ExpertParallel (split_into_stages' probe builds its `miniature`). Cost, measured on 2 gloo ranks
of a 2-core CPU (tests/test_self_check.py prints it): 0.03-0.3 s per call for a tiny HF model
(three miniatures built, three forward and backward passes, one all-reduce of the verdicts).
"""
import copy
import time
from contextlib import contextmanager
from functools import partial

import torch

from .. import numerics
from ..runtime.comm import GroupLike
from ..runtime.context import context

LAYERS, HEAD_DIM, TOKENS, BATCH = 2, 16, 8, 2
NOISE = 0.1          # added to the constant-initialised parameters (norms start at 1 or 0)
COPY_LIMIT = 50e6    # a model that is not Hugging Face's is checked on a copy up to this size
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K = ("num_experts_per_tok", "moe_topk", "top_k")
INTERMEDIATE = ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim")
EXPERT_WIDTH = ("moe_intermediate_size", "shared_expert_intermediate_size")
MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
       "v_head_dim": 8}


class SelfCheckError(ValueError):
    """A block's result on the miniature differs from one device (one line: what and where)."""


def is_hugging_face(model):
    """A Hugging Face model: built from a config with a model_type (its class knows it)."""
    return getattr(getattr(model, "config", None), "model_type", None) is not None \
        and hasattr(type(model), "config_class")


def _set(config, attr, value):
    if isinstance(getattr(config, attr, None), int) and not isinstance(getattr(config, attr),
                                                                       bool):
        setattr(config, attr, value)


def shrunk_config(config, divisor=1):
    """A copy of a Hugging Face config at miniature size (module doc); heads, vocabulary, MLP
    and experts divisible by `divisor` (the group's size). Per-layer lists keep one layer of
    each kind (Gemma's sliding and full attention)."""
    config = copy.deepcopy(config)
    layers = config.num_hidden_layers
    heads = 2 * divisor
    kv = getattr(config, "num_key_value_heads", None)
    grouped = isinstance(kv, int) and kv < config.num_attention_heads
    config.num_attention_heads = heads
    _set(config, "num_key_value_heads", divisor if grouped else heads)
    _set(config, "num_kv_heads", divisor if grouped else heads)
    try:
        _set(config, "head_dim", HEAD_DIM)
    except AttributeError:   # a property: hidden_size / heads (Falcon)
        pass
    hidden = heads * HEAD_DIM
    config.hidden_size = hidden
    for attr in INTERMEDIATE:
        _set(config, attr, 2 * hidden)
    for attr in EXPERT_WIDTH:
        _set(config, attr, hidden)
    for attr in EXPERTS:
        _set(config, attr, max(4, 2 * divisor))
    for attr in TOP_K:
        _set(config, attr, min(getattr(config, attr, 2) or 2, 2))
    for attr, value in MLA.items():
        _set(config, attr, value)
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):   # MLA's derived sizes
        _set(config, "qk_head_dim", config.qk_rope_head_dim + config.qk_nope_head_dim)
        _set(config, "head_dim", config.qk_rope_head_dim)
    keep = _layers_to_keep(getattr(config, "layer_types", None), layers)
    for attr, value in list(vars(config).items()):   # per-layer lists: the kept layers' entries
        if isinstance(value, list) and len(value) == layers and layers > LAYERS:
            setattr(config, attr, [value[i] for i in keep])
    config.num_hidden_layers = min(layers, LAYERS)
    vocab = 64 * divisor
    for attr, value in list(vars(config).items()):   # special tokens inside the vocabulary
        if attr.endswith("token_id") and isinstance(value, int) and value >= vocab:
            setattr(config, attr, vocab - 1)
    config.vocab_size = vocab
    return config


def _layers_to_keep(kinds, layers):
    """LAYERS layer indices, the first of each kind first (all kinds, if LAYERS allows)."""
    if not isinstance(kinds, list) or len(kinds) != layers:
        return list(range(min(layers, LAYERS)))
    firsts = [kinds.index(kind) for kind in dict.fromkeys(kinds)][:LAYERS]
    rest = [i for i in range(layers) if i not in firsts]
    return sorted(firsts + rest[:LAYERS - len(firsts)])


def miniature(model, divisor=1, seed=0):
    """A small model of the same class as `model`, seeded (module doc; the caller's random
    state is left as it was); one-line SelfCheckError if none can be built."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _miniature(model, divisor)


def _miniature(model, divisor):
    if is_hugging_face(model):
        try:
            mini = type(model)(shrunk_config(model.config, divisor)).float()
        except Exception as error:   # a family whose config does not shrink this way
            raise SelfCheckError(f"cannot build a miniature {type(model).__name__} to check the "
                                 f"block on ({type(error).__name__}: {str(error)[:120]}); pass "
                                 "verify=False to skip the check") from None
        if hasattr(mini, "set_experts_implementation") and any(
                getattr(mini.config, a, None) for a in EXPERTS):
            mini.set_experts_implementation("eager")   # grouped_mm has no float64 on CPU
    elif sum(p.numel() for p in model.parameters()) <= COPY_LIMIT:
        mini = copy.deepcopy(model).float()
        for module in mini.modules():   # a copied HF block's experts: eager (as above)
            config = getattr(module, "config", None)
            if getattr(config, "_experts_implementation", None) not in (None, "eager"):
                config._experts_implementation = "eager"
    else:
        raise SelfCheckError(f"{type(model).__name__} is not a Hugging Face model and too large "
                             "to check on a copy; pass verify=False to skip the check")
    with torch.no_grad():
        for param in mini.parameters():
            if param.numel() > 1 and bool((param == param.reshape(-1)[0]).all()):
                param.add_(NOISE * torch.randn_like(param))
    return mini.eval()   # no dropout: the three runs must see the same function


def logits_of(output):
    """The logits of a model's output (an HF output object, a dict or a tensor); a base model's
    last hidden state."""
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = output.get(key) if isinstance(output, dict) else getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return output[0]


def _record_outputs(module):
    """Hooks keeping each submodule's first output tensor, in the order they ran."""
    outputs = {}

    def keep(name, sub, args, out):
        out = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(out, torch.Tensor) and out.is_floating_point() and name not in outputs:
            outputs[name] = out.detach().clone()

    handles = [sub.register_forward_hook(partial(keep, name))
               for name, sub in module.named_modules() if name]
    return outputs, handles


def _run(module, ids, seed, forward):
    """One forward and backward; the logits and every submodule's output (by name). The loss
    weighs each output value by a random number (the same in every run): every logit, hence
    every parameter, gets a gradient of its own, whatever the output is."""
    outputs, handles = _record_outputs(module)
    try:
        logits = logits_of(forward(module, ids))
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
        (logits * weights.to(logits)).mean().backward()
    finally:
        for handle in handles:
            handle.remove()
    return logits.detach(), outputs


def _ratio(agreement):
    """error / limit: above 1 fails (inf: nothing to compare where one device has something)."""
    if agreement is None:
        return float("inf")
    if agreement.limit:
        return agreement.error / agreement.limit
    return 0.0 if agreement.error == 0 else float("inf")


def _block(name):
    """The layer a parameter belongs to: its name up to the first layer index."""
    atoms = name.split(".")
    index = next((i for i, a in enumerate(atoms) if a.isdigit()), len(atoms) - 2)
    return ".".join(atoms[:index + 1])


def _culprit(names, failed):
    """The parameter a wrong gradient starts at: a gradient goes wrong where the error enters
    and everywhere upstream of it, so in the last layer with a failure, its first failing
    parameter (registration order: a layer's projections before its norms)."""
    block = _block(names[failed[-1]])
    return next(i for i in failed if _block(names[i]) == block)


def check_against_one_device(model, apply, group: GroupLike = None, *, what="the block",
                             forward=None, gradients=None, seed=0, batch=BATCH, inputs=None):
    """Run `apply` on a miniature of `model` and compare with one device (module doc).
    `apply(mini)` returns the module to run; `forward(module, ids)` its output (default: the
    module called on the ids); `gradients(module)` {name: whole gradient} (default: the
    miniature's own); `inputs(mini, batch)` what the three runs are fed (default: `batch`
    sequences of random token ids, the same on every rank). Returns {seconds, checks, worst};
    raises SelfCheckError in one line."""
    ctx = context()
    group = ctx.group(group)
    forward = forward or (lambda module, ids: module(ids))
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]), ctx.off_the_record(), _memory_kept(ctx.memory):
        device = next((p.device for p in model.parameters() if not p.is_meta), "cpu")
        single = miniature(model, group.size, seed).to(device)   # on the model's device (NCCL)
        exact, mine = numerics.exact_copy(single), copy.deepcopy(single)
        torch.manual_seed(seed)   # the same inputs on every rank (the fork restores the state)
        ids = (inputs(single, batch) if inputs else
               torch.randint(0, _vocabulary(single), (batch, TOKENS))).to(device)
        runs = [_run(m, ids, seed, forward) for m in (single, exact)]
        try:
            applied = apply(mine)
            runs.insert(0, _run(applied, ids, seed, forward))
            grads = gradients(applied) if gradients else {
                n: p.grad for n, p in mine.named_parameters() if p.grad is not None}
        except (RuntimeError, IndexError, TypeError, AttributeError) as error:   # one line
            message = str(error).splitlines()[0][:200] if str(error) else ""
            raise SelfCheckError(f"{what} fails on a miniature {type(model).__name__} over "
                                 f"{group.size} ranks ({type(error).__name__}: {message}); "
                                 "verify=False skips this check") from None
        outputs = [run[1] for run in runs]
        forward_checks = [(f"the output of {name} is", numerics.compare(
            outputs[0][name], outputs[1][name], outputs[2][name]))
            for name in outputs[1] if name in outputs[0]
            and outputs[0][name].shape == outputs[1][name].shape]
        forward_checks.append(("the output is", numerics.compare(*[r[0] for r in runs])))
        reference = [dict(m.named_parameters()) for m in (single, exact)]
        names = [n for n, p in exact.named_parameters() if p.grad is not None]
        grad_checks = [(f"the gradient of {n} is", numerics.compare(
            grads[n], reference[0][n].grad, reference[1][n].grad) if n in grads else None)
            for n in names]
        checks = forward_checks + grad_checks
        ratios = torch.tensor([_ratio(a) for _, a in checks], dtype=torch.float64)
        ratios = ctx.comm.all_reduce(ratios, op="max", group=group, tag="self-check").tolist()
    seconds = time.perf_counter() - start
    failed = [i for i, r in enumerate(ratios) if not r <= 1.0]
    if failed:
        first = failed[0] if failed[0] < len(forward_checks) else len(forward_checks) + \
            _culprit(names, [i - len(forward_checks) for i in failed])
        ratio = ratios[first]
        size = "missing on some rank" if ratio == float("inf") else \
            f"{ratio:.3g}x the rounding limit of labkit.numerics"
        raise SelfCheckError(
            f"{what} would train {type(model).__name__} wrong: on a miniature of it over "
            f"{group.size} ranks, {checks[first][0]} not one device's ({size}); "
            f"{len(failed)} of {len(checks)} checks failed (verify=False skips this check)")
    worst = max(range(len(checks)), key=ratios.__getitem__)
    return dict(seconds=seconds, checks=len(checks),
                worst=(checks[worst][0].rsplit(" ", 1)[0], ratios[worst]))


@contextmanager
def _memory_kept(memory):
    """The rank's memory tracker as it was before the check (a sharding block registers what
    it holds and samples its peaks: the miniature's must not count)."""
    kept = {k: copy.copy(v) if isinstance(v, (dict, list, set)) else v
            for k, v in vars(memory).items()}
    try:
        yield
    finally:
        vars(memory).update(kept)


class _GatherShares(torch.autograd.Function):
    """Every rank's share along dim 0, concatenated in rank order; backward: this rank's part
    (every rank computes the same thing from the whole)."""

    @staticmethod
    def forward(fctx, x, group):
        fctx.group = group
        return context().comm.all_gather(x, group=group, tag="self-check gather")

    @staticmethod
    def backward(fctx, grad):
        return grad.chunk(fctx.group.size)[fctx.group.rank], None


def own_mean(local, size):
    """`local` unchanged, its gradient `size` times: each rank's loss is then the mean over its
    own share (data parallelism's convention), its gradient size x its share of the whole
    batch's mean, and the group's average of the gradients is the whole batch's."""
    return local + (size - 1) * (local - local.detach())


def batch_share_forward(is_applied, group: GroupLike = None, run=None):
    """A `forward` for a block whose ranks each run their own rows of the batch (data
    parallel, ZeRO-3, experts): the applied module on this rank's rows, its output gathered
    (`own_mean`), the same as one device's on the whole batch; the others on the whole batch.
    Pass batch=BATCH * the group's size to check_against_one_device."""
    group = context().group(group)
    run = run or (lambda module, ids: module(ids))

    def forward(module, ids):
        if not is_applied(module):
            return run(module, ids)
        local = logits_of(run(module, ids.chunk(group.size)[group.rank]))
        return _GatherShares.apply(own_mean(local, group.size), group)
    return forward


def _vocabulary(mini):
    head = mini.get_output_embeddings() if hasattr(mini, "get_output_embeddings") else None
    vocab = getattr(head, "out_features", None) or getattr(
        getattr(mini, "config", None), "vocab_size", None)
    if vocab is None:
        raise SelfCheckError(f"{type(mini).__name__}: no vocabulary size to draw tokens from; "
                             "pass verify=False to skip the check")
    return vocab
