"""Expert parallelism: the E experts of a Mixture-of-Experts layer spread over N ranks, tokens
sent to them and back by all-to-all.

The idea. An MoE layer replaces an MLP by E expert MLPs and a router that sends each token to
its top-k experts: a token costs k experts' FLOPs while the layer holds E experts' weights.
`ExpertParallel(layer, group)` keeps E/N of the layer's experts on each of the group's N ranks
(taken from the full layer, so the result equals the single-device layer) and replicates the
router. On every forward each rank routes its own tokens, then
  1. all_gather of every rank's (k, E) routing counts (and token count): the whole group's
     queue is then known everywhere, so capacity and drops are decided as on one device;
  2. all_to_all "dispatch": each kept (token, choice) row goes to the rank holding its expert;
  3. the local experts run on the rows that arrived;
  4. all_to_all "combine": the outputs go home, where the gate weights scale and sum them.
Backward mirrors it: the gradient of an all-to-all is the reverse all-to-all.

Expert tensor parallelism (`tp_group`, expert_tp.py; Megatron-Core's ETP, = TP by default):
each local expert's MLP split over a TP group as a dense MLP is (first linear colwise, last
rowwise); every TP rank routes the same tokens (SP's shards all-gathered first), sends the same
rows over EP (the all-to-alls below, unchanged), computes its slice of each expert's ffn, and
the partial outputs are summed over TP once, at the layer's output (all-reduce; SP:
reduce-scatter): the dense MLP's TP traffic, + the router's gradient summed over TP.

Memory per rank: the replicated part (router) + E/N experts (each / tp under expert TP: the
experts' 3 h ffn (SwiGLU; GELU 2 h ffn) x E / (N tp)), their gradients and optimizer
state; activations: the ~T k rows received (balanced routing, T tokens per rank).
Communication per layer and step, per rank: 4 all-to-alls (2 forward, 2 backward) of the
T k h dispatched values, of which (N-1)/N leave the rank: 4 (N-1)/N T k h bytes per value,
plus one all_gather of k E + 1 counts. GShard (Lepikhin et al. 2020, arXiv 2006.16668);
capacity and the load-balancing loss from Switch Transformer (Fedus et al. 2021,
arXiv 2101.03961); the router z-loss from ST-MoE (Zoph et al. 2022, arXiv 2202.08906).

The layer it takes (duck-typed, any nn.Module):
  - `layer.router` (or `layer.gate`): a module, tokens (T, h) -> logits (T, E) (or a tuple
    whose first element they are, as transformers' current routers return);
  - `layer.experts`: an nn.ModuleList of E experts (or a ModuleDict keyed "0".."E-1"), each
    (n, h) -> (n, h); after wrapping it holds this rank's experts only, keyed by their global
    index, so parameter names stay those of the full layer (`experts.5.fc1.weight`);
  - `top_k` and `capacity_factor` on the layer or its config (`layer.moe`, `layer.config`);
    capacity_factor None means no capacity (nothing is dropped); optional: `norm_topk_prob`
    (renormalise the k gate weights or not) and `shared_forward(tokens)` (a dense expert every
    token passes, added to the routed output);
  - or a transformers sparse MoE block (Mixtral, Qwen2-MoE, either expert format), adapted and
    checked against itself by `hf_experts.as_expert_layer`, refused in one line otherwise.
Routing conventions (labkit.models.MoELayer's): softmax over experts, the top-k experts; top-1
keeps the probability (Switch), top-k > 1 renormalises the k probabilities to sum to 1
(Mixtral). Capacity C = ceil(capacity_factor * k * T_group / E) slots per expert, T_group the
tokens of the whole group. Queue order (GShard): every first choice of the group (rank by rank,
tokens in order) before any second choice; assignments past C are dropped and add nothing.

Gradients. Replicated parameters (the router) get this rank's gradient: average them over
the data-parallel ranks as for any replicated parameter (DataParallel, or an all_reduce).
An expert's gradient sums the contributions of every rank's tokens (the backward all-to-all
brings them), and the block divides it by N: with each rank's loss the mean over its own
tokens (what data parallelism assumes), every gradient is then the one of the group's mean
loss. `aux_loss` (Switch) and `z_loss` are this rank's terms, scaled so that their mean over
the group equals the single-device layer's over the group's tokens.
"""
import re

import torch
import torch.nn as nn

from ..runtime.comm import GroupLike
from ..runtime.context import context
from . import expert_tp
from .flat import FlatBuffer, average_gradients
from .hf_experts import as_expert_layer, is_hf_module, router_logits, stack_experts
from .mappings import all_to_all_rows
from .moe_routing import (capacity, choice_counts, kept_per_rank,  # noqa: F401
                          queue_positions, top_k_gates)
from .self_check import (BATCH, COPY_LIMIT, TOKENS, batch_share_forward,
                         check_against_one_device)
from .tp_shards import gather_params


def check_expert_parallel(experts, top_k, capacity_factor, ranks):
    """One plain line for a layout that cannot work (called before anything runs)."""
    if experts < 1:
        raise ValueError(f"an MoE layer needs at least 1 expert, got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({experts}), "
                         f"got {top_k}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None: no capacity), "
                         f"got {capacity_factor}")
    if experts % ranks:
        raise ValueError(f"{experts} experts do not split evenly over {ranks} expert-parallel "
                         f"ranks: the number of experts must divide by the EP group size")


# --------------------------------------------------------------------------------- the block

class ExpertParallel(nn.Module):
    """`layer`'s experts spread over `group` (None: the world); see the module docstring.
    verify: None (default) checks a transformers block (not labkit's own layers; not under
    expert TP) first: on a copy of it, each rank routing its own rows of random hidden states,
    the output and every gradient (replicated ones averaged, experts gathered) must be one
    device's (self_check.py; cost, measured on 2 gloo ranks of a busy 2-core CPU: ~0.03 s per
    block of a tiny Qwen2-MoE). True forces it, False skips it."""

    def __init__(self, moe_layer: nn.Module, group: GroupLike = None, tag: str = "moe", *,
                 tp_group: GroupLike = None, sequence_parallel: bool = False,
                 expert_plan=None, verify: bool | None = None) -> None:
        super().__init__()
        given = moe_layer
        if is_hf_module(moe_layer) or not _has_setting(moe_layer, "capacity_factor"):
            # transformers' blocks name no capacity: re-expressed and checked (hf_experts)
            moe_layer = as_expert_layer(moe_layer)
        if verify or (verify is None and tp_group is None and is_hf_module(given) and sum(
                p.numel() for p in given.parameters()) <= COPY_LIMIT):
            _verify(given, context().group(group), tag)
        self.group = context().group(group)
        self.tag = tag
        experts = _expert_list(getattr(moe_layer, "experts", None))
        self.num_experts, n = len(experts), self.group.size
        self.top_k = int(_setting(moe_layer, "top_k"))
        self.capacity_factor = _setting(moe_layer, "capacity_factor")
        self.norm_topk_prob = _setting(moe_layer, "norm_topk_prob", None)
        # DeepSeek-V2 scales the routed experts' gate weights (hf_experts reads it)
        self.routed_scaling_factor = _setting(moe_layer, "routed_scaling_factor", 1.0)
        check_expert_parallel(self.num_experts, self.top_k, self.capacity_factor, n)
        if _setting(moe_layer, "dense", False):
            raise ValueError("ExpertParallel: a dense-dispatch layer runs every expert on "
                             "every token; there is nothing to dispatch")
        self._router_name = _router_name(moe_layer)
        per_rank = self.num_experts // n
        self.per_rank = per_rank
        self.local_experts = range(self.group.rank * per_rank, (self.group.rank + 1) * per_rank)
        # what every expert's state looks like, to gather them later (full_state_dict)
        self._expert_state = [[(k, t.shape, t.numel()) for k, t in e.state_dict().items()]
                              for e in experts]
        # expert tensor parallelism (expert_tp.py): each local expert split over tp_group
        self.tp_group = context().group(tp_group) if tp_group is not None else None
        self.tp = self.tp_group.size if self.tp_group is not None else 1
        self.sequence_parallel = sequence_parallel and self.tp > 1
        if self.tp > 1:
            expert_tp.split_layer(moe_layer, [experts[e] for e in self.local_experts],
                                  self.tp_group, expert_plan, tag)
        moe_layer.experts = nn.ModuleDict({str(e): experts[e] for e in self.local_experts})
        self.module = moe_layer
        self._local = dict(moe_layer.experts.items())   # what runs (also once FullyShard wraps)
        self.run_every_expert = False
        if n > 1:   # an expert's gradient sums all ranks' tokens: make it the group's mean
            self._mean_over_group(moe_layer.experts.parameters())
        self.aux_loss = self.z_loss = torch.zeros(())
        self.routing = {}

    def forward(self, x):
        comm, group, tag = context().comm, self.group, self.tag
        E, k, n = self.num_experts, self.top_k, self.group.size
        if self.tp > 1:   # every TP rank: the same tokens (expert_tp.py)
            x = expert_tp.enter(x, self.tp_group, self.sequence_parallel, tag)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = router_logits(getattr(self.module, self._router_name), tokens)
        probs, expert, weight = top_k_gates(logits, k, self.norm_topk_prob)
        if self.routed_scaling_factor != 1.0:
            weight = weight * self.routed_scaling_factor
        # 1. every rank's routing counts: the group's queue, the same on every rank
        mine = torch.cat([choice_counts(expert, E).flatten(),
                          torch.tensor([tokens.shape[0]], device=tokens.device)])
        everyone = comm.all_gather(mine[None], group=group, tag=f"{tag} counts")
        counts, group_tokens = everyone[:, :-1].reshape(n, k, E), int(everyone[:, -1].sum())
        slots = capacity(group_tokens, E, k, self.capacity_factor)
        position = queue_positions(expert, E, counts, group.rank)
        kept = position < slots
        # 2. my kept (token, choice) rows ordered by (expert, slot): grouped by destination
        tok, choice = kept.nonzero(as_tuple=True)
        dest = expert[tok, choice]
        order = (dest * slots + position[tok, choice]).argsort()
        tok, choice, dest = tok[order], choice[order], dest[order]
        send = torch.bincount(dest // self.per_rank, minlength=n).tolist()
        arriving = kept_per_rank(counts, slots)[:, self.local_experts.start:
                                                self.local_experts.stop]      # (N, E/N)
        recv = arriving.sum(dim=1).tolist()
        rows = tokens[tok]
        if torch.is_grad_enabled() and not rows.requires_grad:
            # every rank must take part in both backward all-to-alls, whatever it holds
            rows = rows.detach().requires_grad_()
        rows = all_to_all_rows(rows, group, send, recv, f"{tag} dispatch")
        # 3. my experts on the rows that arrived (by source rank, then expert, then slot)
        row_expert = torch.arange(self.local_experts.start, self.local_experts.stop,
                                  device=rows.device).repeat(n)
        row_expert = row_expert.repeat_interleave(arriving.flatten())
        done = all_to_all_rows(self._run_experts(rows, row_expert), group, recv, send,
                               f"{tag} combine")
        # 4. home again: weight by the gates and sum a token's choices
        out = torch.zeros_like(tokens).index_add(0, tok, done * weight[tok, choice, None])
        if hasattr(self.module, "shared_forward"):   # a shared expert every token passes
            out = out + self.module.shared_forward(tokens)
        if self.tp > 1:   # computed alike on every TP rank, its gradient summed over TP
            logits = expert_tp.once_over_tp(logits, self.tp)
            probs = logits.softmax(dim=-1)
        self._router_losses(logits, probs, counts, group_tokens)
        self.routing = dict(load=counts[group.rank].sum(dim=0), dropped=int((~kept).sum()),
                            capacity=slots, sent=sum(send), received=sum(recv))
        if self.tp > 1:   # each TP rank's partial outputs summed, once
            return expert_tp.leave(out.view(shape), self.tp_group, self.sequence_parallel, tag)
        return out.view(shape)

    def _mean_over_group(self, params):
        n = self.group.size
        for p in params:
            if p.requires_grad:
                p.register_hook(lambda grad: grad / n)

    def use_sharded_experts(self, sharded: nn.Module, compute_parameters) -> None:
        """Run this rank's experts through `sharded`, a module that now holds them (ZeRO-3 of
        the experts over their replicas: the FullyShard hybrid.py's `shard_experts` builds),
        its forward computing with `compute_parameters`, whose gradients are then divided by
        N as the whole experts' were. Each local expert then runs on every forward, on no rows
        if none came: a sharded expert's gathers and reduce-scatters are collectives every
        replica must join (its gradient is then zero, not None)."""
        self.module.experts, self.run_every_expert = sharded, True
        if self.group.size > 1:   # the hooks on the whole parameters compute no more
            self._mean_over_group(compute_parameters)

    def _run_experts(self, rows, row_expert):
        # rows * 0 keeps the arrived rows in the graph even when none is for a local expert
        out = rows * 0
        for e in self.local_experts:
            idx = (row_expert == e).nonzero().squeeze(1)
            # an expert no token reached keeps grad None, as on one device (unless sharded)
            if idx.numel() or self.run_every_expert:
                out = out.index_copy(0, idx, self._local[str(e)](rows[idx]))
        return out

    def _router_losses(self, logits, probs, counts, group_tokens):
        """Switch: E sum_e f_e P_e over the group (f_e: fraction of the group's assignments
        routed to e; P_e: the group's mean probability); this rank's share times N. z-loss:
        mean over my tokens of logsumexp(logits)^2."""
        load = counts.sum(dim=(0, 1))
        fraction = load.to(probs.dtype) / load.sum()
        share = self.num_experts * (fraction * probs.sum(dim=0)).sum() / group_tokens
        self.aux_loss = share * self.group.size
        self.z_loss = logits.logsumexp(dim=-1).pow(2).mean()

    def full_state_dict(self):
        """The wrapped layer's state with every expert gathered, by the single-device names
        (`router.weight`, `experts.5.fc1.weight`, ...). A collective: every rank of the group
        calls it."""
        out = {k: t.detach().clone() for k, t in self.module.state_dict().items()
               if not k.startswith("experts.")}
        return self._gather_experts(out, self._whole_state)

    def full_gradients(self):
        """{name: gradient} by the single-device names: the replicated parameters' averaged
        over the group (each rank's tokens' share, as data parallelism averages them), every
        expert's gathered (zeros where no token came). A collective (the self-check's)."""
        comm = context().comm
        out = {k: comm.all_reduce(p.grad.clone(), op="avg", group=self.group)
               for k, p in self.module.named_parameters()
               if not k.startswith("experts.") and p.grad is not None}
        return self._gather_experts(out, lambda expert: [
            torch.zeros_like(p) if p.grad is None else p.grad for p in expert.parameters()])

    def _gather_experts(self, out, tensors_of):
        mine = FlatBuffer([t.detach() for e in self.local_experts
                           for t in tensors_of(self.module.experts[str(e)])])
        layouts = [FlatBuffer([torch.empty(shape, device="meta") for e in self._rank_experts(r)
                               for _, shape, _ in self._expert_state[e]])
                   for r in range(self.group.size)]    # every rank holds at least one expert
        flat = torch.cat([mine.data, mine.data.new_zeros(max(f.numel for f in layouts)
                                                         - mine.numel)])
        everyone = context().comm.all_gather(flat[None], group=self.group,
                                             tag=f"{self.tag} gather experts")
        for r, layout in enumerate(layouts):
            names = [f"experts.{e}.{name}" for e in self._rank_experts(r)
                     for name, *_ in self._expert_state[e]]
            out.update(zip(names, (v.clone() for v in layout.views(everyone[r]))))
        return out

    def _whole_state(self, expert):   # under expert TP: its slices gathered over TP
        return (gather_params(expert) if self.tp > 1 else expert.state_dict()).values()

    def _rank_experts(self, member):
        return range(member * self.per_rank, (member + 1) * self.per_rank)

    def extra_repr(self):
        return (f"experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, group={list(self.group.ranks)}, "
                f"local_experts={list(self.local_experts)}, tp={self.tp}")


def full_parameters(model):
    """{name: whole tensor} of `model` by the unwrapped model's names, the experts of every
    ExpertParallel layer gathered from its group (a collective: every rank calls it)."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, ExpertParallel)}
    inside = tuple(f"{name}." for name in layers)
    out = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith(inside)}
    for name, layer in layers.items():
        out.update({f"{name}.{k}": t for k, t in layer.full_state_dict().items()})
    return out


# --------------------------------------------------- a model's experts and their replicas

EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


def is_expert(name):
    """Whether a parameter name (`blocks.0.mlp.experts.5.fc1.weight`) is an expert's."""
    return EXPERT_NAME.search(name) is not None


def expert_groups(ep):
    """(EP group, expert-replica group or None) of this rank: EP groups are neighbouring
    ranks, as the `ep` of `ctx.mesh(dp=world, ep=ep)` lays them out; each expert then has
    world/ep replicas. Every rank calls this, same order."""
    ctx = context()
    world = ctx.world_size
    if ep == world:
        return ctx.world, None
    ep_group = ctx.split_groups([list(range(d * ep, (d + 1) * ep)) for d in range(world // ep)])
    replicas = ctx.split_groups([list(range(i, world, ep)) for i in range(ep)])
    return ep_group, replicas


def average_moe_gradients(model, replicas):
    """Dense gradients averaged over the world; expert gradients (already the EP group's mean,
    see ExpertParallel) averaged over their replicas. An expert that got no token on any
    replica keeps grad None, as on one device, instead of an Adam step on zeros."""
    named = list(model.named_parameters())
    average_gradients([p for n, p in named if not is_expert(n)], None, skip_unused=True,
                      tag="dense grads")
    if replicas is not None:
        average_gradients([p for n, p in named if is_expert(n)], replicas, skip_unused=True,
                          tag="expert grads")


def routing_stats(model):
    """Per layer of `model.moe_layers()`: this rank's assignments routed to each expert (before
    drops), its dropped assignments and the rows it sent and received (a single-device MoE
    layer, read from its `last` routing: the whole batch, nothing sent)."""
    layers = model.moe_layers()
    if layers and isinstance(layers[0], ExpertParallel):
        routes = [m.routing for m in layers]
        return dict(load=[r["load"].tolist() for r in routes],
                    dropped=sum(r["dropped"] for r in routes),
                    sent=[r["sent"] for r in routes], received=[r["received"] for r in routes])
    load = [sum(((r.expert[:, :, None] == torch.arange(m.moe.experts)).sum((0, 1))
                 for r in m.last), torch.zeros(m.moe.experts, dtype=torch.long)).tolist()
            for m in layers]
    return dict(load=load, dropped=sum(r.dropped for m in layers for r in m.last),
                sent=[0] * len(layers), received=[0] * len(layers))


def merge_routing(per_rank):
    """Every rank's per-step `routing_stats` summed over the ranks: (dropped assignments per
    step, the last step's load per layer and expert)."""
    last = [steps[-1]["load"] for steps in per_rank]
    dropped = [sum(steps[s]["dropped"] for steps in per_rank) for s in range(len(per_rank[0]))]
    load = [[sum(rank[layer][e] for rank in last) for e in range(len(last[0][layer]))]
            for layer in range(len(last[0]))]
    return dropped, load


def parameter_counts(model):
    """(dense elements, dense tensors, expert elements, expert tensors) of `model`."""
    dense, expert = [], []
    for name, p in model.named_parameters():
        (expert if is_expert(name) else dense).append(p.numel())
    return sum(dense), len(dense), sum(expert), len(expert)


# ------------------------------------------------------------------------ the self-check

def _verify(block, group, tag):
    """The self-check (self_check.py) on a copy of `block`: each rank routes its own rows of a
    random batch of hidden states through the same ExpertParallel, the outputs gathered, the
    replicated gradients averaged and the experts' gathered, against the block on one device."""
    hidden = _router_width(block)
    check_against_one_device(
        block, lambda mini: ExpertParallel(mini, group, tag, verify=False), group,
        what="ExpertParallel", batch=BATCH * group.size,
        inputs=lambda mini, batch: torch.randn(batch, TOKENS, hidden),
        forward=batch_share_forward(lambda m: isinstance(m, ExpertParallel), group,
                                    run=lambda m, x: m(x.to(next(m.parameters()).dtype))),
        gradients=lambda ep: stack_experts(ep.full_gradients()))


def _router_width(block):
    router = getattr(block, "router", None) or getattr(block, "gate", None)
    weight = getattr(router, "weight", None)
    if weight is None:
        raise ValueError(f"ExpertParallel: {type(block).__name__} has no router weight to "
                         "read the hidden size from; pass verify=False to skip the check")
    return weight.shape[-1]


# ------------------------------------------------------------------------ the duck type

def _has_setting(layer, name):
    return any(h is not None and hasattr(h, name) for h in (
        layer, getattr(layer, "moe", None), getattr(layer, "config", None)))


def _setting(layer, name, default=...):
    for holder in (layer, getattr(layer, "moe", None), getattr(layer, "config", None)):
        if holder is not None and hasattr(holder, name):
            return getattr(holder, name)
    if default is not ...:
        return default
    raise ValueError(f"ExpertParallel: the layer has no {name} (set layer.{name}, or "
                     f"layer.moe.{name} on a config)")


def _expert_list(experts):
    if isinstance(experts, nn.ModuleDict):
        if sorted(experts.keys(), key=_as_int) != [str(i) for i in range(len(experts))]:
            raise ValueError("ExpertParallel: a ModuleDict of experts must be keyed "
                             f"'0'..'{len(experts) - 1}', got {list(experts.keys())}")
        return [experts[str(i)] for i in range(len(experts))]
    if isinstance(experts, nn.ModuleList):
        return list(experts)
    raise ValueError("ExpertParallel: layer.experts must be an nn.ModuleList of the experts "
                     f"(or a ModuleDict keyed by expert index), got {type(experts).__name__}")


def _as_int(key):
    return int(key) if key.isdigit() else -1


def _router_name(layer):
    for name in ("router", "gate"):
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    raise ValueError("ExpertParallel: the layer needs a router module (layer.router or "
                     "layer.gate) that maps tokens to one logit per expert")
