"""Putting it together: DP x TP x PP (x EP) on one model, composed from the building blocks.

The world is a mesh (labkit.runtime.mesh: pp outermost, tp innermost, so a TP group sits inside
a node). The model, as an nn.Sequential of layers, is cut into pp x v pipeline stages; rank
(pp=i, dp=j, tp=k) holds stages i, i+pp, ... (v of them when interleaved), each split over its
TP group by `parallelize` (heads and MLP columns, + sequence parallelism); the stages talk over
the PP group with `PipelineSchedule`; the dp replicas of a stage average their gradients over
the DP group after the pipeline flush (Megatron-LM's order, Narayanan et al. 2021,
arXiv 2104.04473: TP inside a node, PP across nodes, DP outermost) and step with a plain
optimizer or with ZeRO-1 (`ShardedOptimizer`) over the same group. An MoE model's experts are
spread by `ExpertParallel` over EP groups carved out of DP; an expert's gradient is averaged
over its replicas (`ep_dp`), every other one over DP.

`zero_stage=3` (ZeRO-3 / FSDP, torchtitan's order: TP -> PP stages -> FullyShard) wraps each of
this rank's TP-split stages in `FullyShard` (one unit per layer) over the DP group; HSDP
(`dp_replicate=R`, torchtitan's ParallelDims names): the dp ranks split into R replicas of
dp_shard = dp / R ranks each, FullyShard shards within `dp_shard` (consecutive dp indices) and
the shards' gradients are averaged across `dp_replicate` (one all-reduce per step). Under a
pipeline, FullyShard gathers and reduce-scatters *per micro-batch*: it frees the full weights
after each forward (reshard_after_forward) and each micro-batch's backward ends with its own
reduce-scatter, added into the shards' `.grad` (FullyShard has no "accumulate unsharded, reduce
once" mode). So DP traffic per rank and step is 3 m (S-1)/S x the stage's bytes (m
micro-batches, S = dp_shard) where ZeRO-1 moves 2 (S-1)/S once: (3m/2)x the bytes, for model
states of 16 Ψ / (tp pp S) instead of (8 + 8/S) Ψ / (tp pp) (fp32 Adam). With sequence
parallelism a replicated weight's gradient, which SP sums over TP by a hook on the parameter
(lost when FullyShard computes with its own full copies), is summed over TP on the shards after
the pipeline: one all-reduce of those shards per step. Experts are not sharded (refused).

Memory per GPU (model states): Ψ / (tp * pp) of the weights each (+ 1/ep of the experts);
ZeRO-1 divides the optimizer state by dp too, ZeRO-3 weights, gradients and optimizer state by
dp_shard. Activations: those of the micro-batches in flight on this stage, / tp with sequence
parallelism. Communication per step: TP 4 collectives
per layer and micro-batch of b*s*h values (inside a node); PP 2 point-to-point messages per
stage boundary and micro-batch of b*s*h/(tp if SP); DP one all-reduce of the stage's gradients
(2 (dp-1)/dp x its bytes; ZeRO-1 the same in reduce-scatter + all-gather form).

    mesh = ctx.mesh(dp=2, tp=2, pp=2)
    hybrid = HybridParallel(model, mesh, loss_fn, tp_plan=plan, n_microbatches=4)
    loss = hybrid.step(x, y)                # forward, backward, DP average, optimizer step

Serving composes the same blocks (`HybridGenerator`, labkit.parallel.serving's idea): the
requests split over the replicas (dp), the model split by TP, its MoE layers spread over EP
(attention replicated) or its layers cut into pp stages run by `PipelineGenerator`.
"""
import itertools

import torch
import torch.nn as nn

from ..runtime.context import context
from ..runtime.memory import optimizer_state_tensors
from .moe import ExpertParallel
from .pipeline import PipelineSchedule, PipelineStage, split_into_stages
from .serving import PipelineGenerator, generate, new_cache, split_requests
from .flat import average_gradients, unwrapped_name
from .fully_shard import FullyShard, one_unit_per_layer
from .tp_shards import all_gather_dim, split_parts
from .tensor_parallel import gather_params, parallelize
from .tensor_parallel_plan import plan_for
from .zero import ShardedOptimizer


def moe_layers(module):
    """(parent, attribute, layer) of every Mixture-of-Experts layer: a router and experts."""
    found = []
    for name, child in module.named_modules():
        for attr, layer in child.named_children():
            if hasattr(layer, "experts") and (hasattr(layer, "router") or hasattr(layer, "gate")):
                found.append((child, attr, layer))
    return found


SCHEDULES = ("gpipe", "1f1b", "interleaved")


def validate_dims(*, dp, tp, pp, ep=1, dp_replicate=1, zero_stage=0, sequence_parallel=False,
                  experts=0, world_size=None):
    """The one check of a mesh's degrees (like torchtitan's ParallelDims._validate): a one-line
    ValueError naming the argument, before any group is made."""
    sizes = dict(dp=dp, tp=tp, pp=pp, ep=ep, dp_replicate=dp_replicate)
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if zero_stage not in (0, 1, 3):
        raise ValueError(f"zero_stage must be 0, 1 or 3, got {zero_stage!r} (ZeRO-2 would "
                         "shard gradients the pipeline accumulates; 3 is FullyShard)")
    if dp % dp_replicate:
        raise ValueError(f"dp_replicate={dp_replicate} does not divide dp={dp} "
                         "(HSDP: dp = dp_replicate x dp_shard)")
    if dp_replicate > 1 and zero_stage != 3:
        raise ValueError(f"dp_replicate={dp_replicate} needs zero_stage=3 (HSDP shards within "
                         f"dp_shard; with zero_stage={zero_stage} every dp rank is a replica)")
    if zero_stage == 3 and (ep > 1 or experts):
        raise ValueError(f"zero_stage=3 with experts (ep={ep}) is not composed here: "
                         "FullyShard would shard the expert weights over all of dp, whose EP "
                         "ranks hold different experts")
    if world_size is not None and world_size != dp * tp * pp:
        raise ValueError(f"world_size={world_size} but dp x tp x pp = {dp * tp * pp}")


def dp_groups(mesh, dp_replicate):
    """(dp_shard, dp_replicate) groups of this rank: dp index i is replica i // S, shard
    member i % S (S = dp / dp_replicate: consecutive dp ranks shard together, torchtitan's
    order). Every rank calls it (it makes groups)."""
    dp = mesh.sizes["dp"]
    if dp_replicate == 1:
        return mesh["dp"], None
    size = dp // dp_replicate
    table = mesh.table()

    def partition(key):
        groups = {}
        for row in table:
            rest = tuple(row[d] for d in ("pp", "cp", "tp"))
            groups.setdefault((rest, key(row["dp"])), []).append(row["rank"])
        return list(groups.values())
    shard = mesh.ctx.split_groups(partition(lambda i: i // size))
    replicate = mesh.ctx.split_groups(partition(lambda i: i % size))
    return shard, replicate


def check_layout(*, dp, tp, pp, ep=1, zero=0, schedule="1f1b", microbatches=4, virtual=1,
                 sequence_parallel=False, experts=0, layers, heads, ffn, vocab, seq,
                 global_batch, dp_replicate=1):
    """One-line ValueError (CLI flag names) for a mesh layout a GPT of this shape or this batch
    cannot take, before any rank starts: TP must divide what it splits, each pipeline stage
    needs a layer (the embeddings and the head are stages of their own), the batch must split
    into dp replicas x micro-batches, EP must divide the experts and DP."""
    validate_dims(dp=dp, tp=tp, pp=pp, ep=ep, dp_replicate=dp_replicate, zero_stage=zero,
                  sequence_parallel=sequence_parallel, experts=experts)
    for name, value in dict(microbatches=microbatches, virtual=virtual).items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}")
    for name, size in dict(heads=heads, ffn=ffn, vocab=vocab,
                           **({"seq": seq} if sequence_parallel else {})).items():
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


class HybridParallel:
    """Train `model` (an nn.Sequential, or a model with `as_sequential()`) on a `mesh`.

    loss_fn(output, target) on the last stage; tp_plan: `parallelize`'s plan with names of
    the sequential (e.g. {"*.attn.qkv": "colwise", ...}); schedule / n_microbatches / virtual:
    the pipeline's; expert_parallel: wrap every MoE layer in ExpertParallel over mesh["ep"];
    zero_stage 0 (a plain optimizer), 1 (ShardedOptimizer over the DP group) or 3 (each stage
    in FullyShard over `dp_shard`; `dp_replicate` > 1: HSDP, the shards' gradients averaged
    over `dp_replicate`). After construction: `dp_shard` / `dp_replicate` (the groups; None
    where there is no such dimension), `stage_params` (this rank's stages' parameters after
    TP, before FullyShard shards them).
    """

    def __init__(self, model, mesh, loss_fn, *, tp_plan=None, sequence_parallel=False,
                 schedule="1f1b", n_microbatches=4, virtual=1, balance="layers",
                 expert_parallel=False, zero_stage=0, dp_replicate=1,
                 optimizer_class=torch.optim.Adam, **optimizer_defaults):
        validate_dims(dp=mesh.sizes["dp"], tp=mesh.sizes["tp"], pp=mesh.sizes["pp"],
                      ep=mesh.ep, dp_replicate=dp_replicate, zero_stage=zero_stage,
                      sequence_parallel=sequence_parallel and mesh.sizes["tp"] > 1,
                      experts=int(bool(expert_parallel)))
        self.ctx, self.mesh, self.zero_stage = context(), mesh, zero_stage
        self.dp_shard, self.dp_replicate = (dp_groups(mesh, dp_replicate) if zero_stage == 3
                                            else (None, None))
        pp = mesh.sizes["pp"]
        total = pp * virtual
        modules = split_into_stages(model, total, balance)
        mine = list(range(mesh.coords["pp"], total, pp))
        self._tp_splits = {}   # stage -> {name: (tp_split, tp_group)}: FullyShard hides them
        self.stage_params = 0  # this rank's parameters after TP, before FullyShard
        self._sp_sum = []      # ZeRO-3 + SP: shards whose gradient is summed over TP
        for s in mine:
            if mesh.sizes["tp"] > 1 and tp_plan:
                parallelize(modules[s], plan_for(modules[s], tp_plan), group=mesh["tp"],
                            sequence_parallel=sequence_parallel)
            if expert_parallel:
                for parent, attr, layer in moe_layers(modules[s]):
                    setattr(parent, attr, ExpertParallel(layer, group=mesh["ep"]))
            self.stage_params += sum(p.numel() for p in modules[s].parameters())
            if zero_stage == 3:   # last, on the TP shards: torchtitan's order
                named = dict(modules[s].named_parameters())
                self._tp_splits[s] = {n: (getattr(p, "tp_split", None),
                                          getattr(p, "tp_group", None))
                                      for n, p in named.items()}
                modules[s] = FullyShard(modules[s], group=self.dp_shard,
                                        units=one_unit_per_layer(modules[s]))
                # SP's replicated weights lose their TP-sum hook to FullyShard's leaves:
                # their shards' gradients are summed over TP after the pipeline instead
                shards = dict(modules[s].module.named_parameters())
                self._sp_sum += [shards[n] for n, p in named.items()
                                 if getattr(p, "_tp_sum", False)]
        self.stages = [PipelineStage(modules[s], s, total, group=mesh["pp"]) for s in mine]
        self.module = nn.ModuleList(stage.module for stage in self.stages)
        self.pipe = PipelineSchedule(self.stages, n_microbatches, loss_fn, schedule=schedule)
        params = list(self.module.parameters())
        expert_ids = {id(p) for _, _, layer in moe_layers(self.module)
                      for p in layer.experts.parameters()}
        self.dense = [p for p in params if p.requires_grad and id(p) not in expert_ids]
        self.experts = [p for p in params if p.requires_grad and id(p) in expert_ids]
        self.optimizers = []
        for group_params, group in ((self.dense, mesh["dp"]), (self.experts, mesh["ep_dp"])):
            if not group_params:
                continue
            if zero_stage == 1:
                opt = ShardedOptimizer(group_params, optimizer_class, group=group, stage=1,
                                       **optimizer_defaults)
            else:   # ZeRO-3: a plain optimizer over the shards is already 1/dp_shard
                opt = optimizer_class(group_params, **optimizer_defaults)
            self.optimizers.append(opt)
        self.ctx.memory.watch(
            params=lambda: list(self.module.parameters()),
            grads=lambda: [p.grad for p in self.module.parameters()],
            optimizer_state=lambda: list(itertools.chain.from_iterable(
                optimizer_state_tensors(o) for o in self.optimizers)))

    @property
    def is_last(self):
        return any(stage.is_last for stage in self.stages)

    def step(self, x=None, target=None):
        """One training step; returns the mean loss on the last stage's ranks, else None."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        with self.ctx.memory.track_activations():
            loss = self.pipe.step(x, target=target)
        if self.zero_stage == 3:   # FullyShard averaged over dp_shard; HSDP: across replicas
            self._sum_over_tp(self._sp_sum)
            if self.dp_replicate is not None:
                average_gradients(self.dense, self.dp_replicate, tag="dp_replicate grads")
        else:   # DP: a stage's replicas average their gradients (one flat all-reduce)
            average_gradients(self.dense, self.mesh["dp"], tag="dp grads")
        average_gradients(self.experts, self.mesh["ep_dp"], tag="ep_dp grads")
        for opt in self.optimizers:
            opt.step()
        return loss

    @torch.no_grad()
    def _sum_over_tp(self, shards):
        """Sum `shards`' gradients over the TP group (one flat all-reduce): TP peers shard a
        replicated weight the same way (equal TP splits: equal flat layouts), so the sum of
        their dp-averaged shards is the shard of the sum that SP's hook would have made."""
        if not shards:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in shards])
        self.ctx.comm.all_reduce(flat, group=self.mesh["tp"], tag="sequence-parallel grads")
        for p, g in zip(shards, flat.split([p.numel() for p in shards])):
            p.grad.copy_(g.view_as(p.grad))

    def full_params(self):
        """{name in the sequential: whole tensor} of this rank's stages: TP shards gathered
        (every rank calls it); experts are this rank's (the union over EP ranks is whole)."""
        out = {}
        for stage in self.stages:
            module = stage.module
            if isinstance(module, FullyShard):
                out.update(self._unshard(module, self._tp_splits[stage.stage_index]))
            elif self.mesh.sizes["tp"] > 1:
                out.update(gather_params(module))
            else:
                out.update({k: p.detach().clone() for k, p in module.named_parameters()})
        return {unwrapped_name(k): v for k, v in out.items()}


    @staticmethod
    def _unshard(module, splits):
        """A FullyShard stage's whole tensors: gathered over dp_shard, then over TP."""
        out = {}
        for name, tensor in module.full_state_dict().items():
            split, group = splits[name]
            if split is not None:
                dim, parts = split
                tensor = torch.cat([all_gather_dim(p, dim, group, "gather params")
                                    for p in split_parts(tensor, dim, parts, group.size)],
                                   dim=dim)
            out[name] = tensor
        return out


class HybridGenerator:
    """Greedy generation of `model` (a TinyGPT-shaped module with `cfg.hidden`) on a `mesh`.

    tp > 1: split by `parallelize(model, tp_plan, mesh["tp"])` (each rank caches its own
    heads); expert_parallel and ep > 1: every MoE layer in ExpertParallel over mesh["ep"];
    pp > 1: cut into pp stages by layers, run by `PipelineGenerator` (the requests in pp
    micro-batches). Each dp rank (replicas x ep) generates its share of the requests. After
    `generate`: `cache_bytes` (this rank's KV cache), `held` (the module this rank serves
    with: its stage, or the whole model), `requests_here`.
    """

    def __init__(self, model, mesh, tp_plan=None, expert_parallel=False):
        self.model, self.mesh = model, mesh
        if mesh.sizes["tp"] > 1:
            parallelize(model, tp_plan, mesh["tp"])
        if expert_parallel and mesh.ep > 1:
            for parent, attr, layer in moe_layers(model):
                setattr(parent, attr, ExpertParallel(layer, group=mesh["ep"], tag="moe"))
        self.cache_bytes, self.held, self.requests_here = 0, model, 0

    def generate(self, requests, new_tokens):
        """This rank's share of `requests` (b, P) -> its (b / dp, new_tokens) greedy tokens."""
        mine = split_requests(requests, self.mesh["dp"])
        self.requests_here = mine.shape[0]
        pp = self.mesh.sizes["pp"]
        if pp == 1:
            cache = new_cache()
            tokens = generate(self.model, mine, new_tokens, cache)
            self.cache_bytes = cache.nbytes()
            return tokens
        stages = split_into_stages(self.model, pp, balance="layers")
        index = self.mesh.coords["pp"]
        stage = PipelineStage(stages[index], index, pp, group=self.mesh["pp"])
        pipe = PipelineGenerator(stage, self.model.cfg.hidden, n_microbatches=pp)
        tokens = pipe.generate(mine, new_tokens)
        self.cache_bytes, self.held = pipe.cache_bytes(), stages[index]
        return tokens
