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

Memory per GPU (model states): Ψ / (tp * pp) of the weights each (+ 1/ep of the experts);
ZeRO-1 divides the optimizer state by dp too. Activations: those of the micro-batches in
flight on this stage, / tp with sequence parallelism. Communication per step: TP 4 collectives
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


def check_layout(*, dp, tp, pp, ep=1, zero=0, schedule="1f1b", microbatches=4, virtual=1,
                 sequence_parallel=False, experts=0, layers, heads, ffn, vocab, seq,
                 global_batch):
    """One-line ValueError (CLI flag names) for a mesh layout a GPT of this shape or this batch
    cannot take, before any rank starts: TP must divide what it splits, each pipeline stage
    needs a layer (the embeddings and the head are stages of their own), the batch must split
    into dp replicas x micro-batches, EP must divide the experts and DP."""
    for name, value in dict(dp=dp, tp=tp, pp=pp, ep=ep, microbatches=microbatches,
                            virtual=virtual).items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}")
    if zero not in (0, 1):
        raise ValueError(f"--zero must be 0 or 1 with a pipeline, got {zero}")
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
    zero_stage 0 (a plain optimizer) or 1 (ShardedOptimizer over the DP group).
    """

    def __init__(self, model, mesh, loss_fn, *, tp_plan=None, sequence_parallel=False,
                 schedule="1f1b", n_microbatches=4, virtual=1, balance="layers",
                 expert_parallel=False, zero_stage=0, optimizer_class=torch.optim.Adam,
                 **optimizer_defaults):
        if zero_stage not in (0, 1):
            raise ValueError(f"zero_stage must be 0 or 1 with pipeline parallelism, got "
                             f"{zero_stage} (ZeRO-2/3 would shard gradients that the pipeline "
                             "accumulates over micro-batches)")
        self.ctx, self.mesh = context(), mesh
        pp = mesh.sizes["pp"]
        total = pp * virtual
        modules = split_into_stages(model, total, balance)
        mine = list(range(mesh.coords["pp"], total, pp))
        for s in mine:
            if mesh.sizes["tp"] > 1 and tp_plan:
                parallelize(modules[s], plan_for(modules[s], tp_plan), group=mesh["tp"],
                            sequence_parallel=sequence_parallel)
            if expert_parallel:
                for parent, attr, layer in moe_layers(modules[s]):
                    setattr(parent, attr, ExpertParallel(layer, group=mesh["ep"]))
        self.stages = [PipelineStage(modules[s], s, total, group=mesh["pp"]) for s in mine]
        self.module = nn.ModuleList(stage.module for stage in self.stages)
        self.pipe = PipelineSchedule(self.stages, schedule, loss_fn, n_microbatches)
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
            else:
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
        # DP: the replicas of a stage average their gradients (one flat all-reduce each group).
        average_gradients(self.dense, self.mesh["dp"], tag="dp grads")
        average_gradients(self.experts, self.mesh["ep_dp"], tag="ep_dp grads")
        for opt in self.optimizers:
            opt.step()
        return loss

    def full_params(self):
        """{name in the sequential: whole tensor} of this rank's stages: TP shards gathered
        (every rank calls it); experts are this rank's (the union over EP ranks is whole)."""
        out = {}
        for stage in self.stages:
            module = stage.module
            if self.mesh.sizes["tp"] > 1:
                out.update(gather_params(module))
            else:
                out.update({k: p.detach().clone() for k, p in module.named_parameters()})
        return {unwrapped_name(k): v for k, v in out.items()}


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
