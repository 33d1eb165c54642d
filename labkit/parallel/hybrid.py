"""Putting it together: DP x TP x PP x CP (x EP) on one model, composed from the building blocks.

The world is a mesh (labkit.runtime.mesh: pp outermost, tp innermost, so a TP group sits inside
a node). The model, as an nn.Sequential of layers, is cut into pp x v pipeline stages; rank
(pp=i, dp=j, tp=k) holds stages i, i+pp, ... (v of them when interleaved), each split over its
TP group by `parallelize_module` (heads and MLP columns, + sequence parallelism); the stages
talk over the PP group with `Schedule1F1B` (or another schedule); the dp replicas of a stage
average their gradients over the DP group after the pipeline flush (Megatron-LM's order,
Narayanan et al. 2021, arXiv 2104.04473: TP inside a node, PP across nodes, DP outermost). An
MoE model's experts are spread by `ExpertParallel` over EP groups carved out of DP, and with tp
> 1 each expert split over the TP group as a dense MLP is (expert TP, parallel/expert_tp.py: the
same tokens and rows on every TP rank, the partial outputs summed over TP at the layer's
output); an expert's gradient is averaged over its replicas (`ep_dp`), every other one over DP.
HybridParallel composes the blocks and nothing more: the optimizer (a plain one, or ZeRO-1's or
ZeRO-2's `ShardedOptimizer` over each gradient group) and the loop are the trainer's
(labkit/runs/trainer.py, as torchtitan's `parallelize_llama` leaves them to its Trainer).

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
the pipeline: one all-reduce of those shards per step.

ZeRO-3 with experts (torchtitan's order: the experts sharded first, then the block): each
MoE layer's experts are sharded by a FullyShard of their own (`shard_experts` below)
over `ep_shard`, the ranks holding the same experts: their dp x cp / ep replicas (`ep_dp`;
under HSDP those within one dp_shard group, ep | dp_shard, so the dp_replicate group holds the
same experts and averages dense and expert shards in one all-reduce); the stage's FullyShard
over dp_shard leaves them alone. Sharding the experts over dp_shard would mix ranks holding
different experts. Model states: dense 16 (Ψ - Ψ_E) / (tp pp S cp), experts 16 Ψ_E / (tp pp S
cp / ep) (Ψ_E: the stage's experts before EP, spread over ep); DP traffic per rank and step,
B_E the bytes of this rank's experts, E = S cp / ep: 3 m (E-1)/E x B_E on ep_dp beside
3 m (S cp - 1)/(S cp) x (B - B_E) on dp_shard (theory/hybrid.fsdp_wire_bytes).

Context parallelism (`cp` > 1; Ring Attention, Liu et al. 2023, arXiv 2310.01889): each rank
holds s / cp tokens of each sequence (zigzag by default: chunks r and 2cp-1-r, balanced under
the causal mask; or contiguous); the caller shards the inputs and the already-shifted targets
alike and gives the embedding the shard's global positions (runs/hybrid.py). Every attention
layer is wrapped in `ContextParallel` over mesh["cp"] after TP (it sees this rank's heads) and
before PP and FullyShard (torchtitan's order), so the pipeline sends activations of s / cp
tokens. The cp ranks hold the same weights as the dp ranks, and with equal shards each rank's
loss is the mean over as many tokens, so the batch's mean loss is the mean over dp x cp and
its gradient the average of the dp x cp ranks' gradients: the gradients are averaged over one
`dp_cp` group (torchtitan folds cp into its FSDP dimension the same way), and ZeRO-1 and
FullyShard shard over dp x cp (dp_shard x cp with HSDP): model states / (dp_shard cp). Bytes
a rank sends per step on cp, per attention layer of its stage and micro-batch (b sequences,
KV = 2 b (h / tp) (s / cp) d values): (cp - 1) KV forward, (cp - 1) KV + cp dKV (fp32)
backward (theory/context_parallel.comm_bytes_per_rank); on dp_cp 2 (N-1)/N x the stage's
gradient bytes, N = dp x cp. With experts each cp rank routes its own tokens (its sequence
shard) through its ep group's all-to-all, as without CP (the ep group holds one cp index);
an expert's gradient is averaged over its replicas, the dp x cp / ep ranks with the same ep
index (`ep_dp`, spanning cp: torchtitan's "ranks that hold the same experts").

Memory per GPU (model states): Ψ / (tp * pp) of the weights each (the experts / (ep tp pp));
ZeRO-1 divides the optimizer state by dp too, ZeRO-3 weights, gradients and optimizer state by
dp_shard (the experts' by dp_shard / ep). Activations: those of the micro-batches in flight
on this stage, / tp with sequence parallelism; per layer and micro-batch sbh (34 + 5 a s / h)
(16-bit, Korthikanti et al. 2022, arXiv 2205.05198), 34 sbh under recompute="selective" (each
attention core checkpointed, parallel/recompute.py: its a s^2 b scores rebuilt in backward, no
collective repeated; under CP the ring core keeps no scores and is left alone), the stage's
input alone under "full" (the pipeline runs the stage's forward again, its forward collectives
with it), or of k blocks per rank under recompute_layers=k (each a CheckpointedLayer).
Communication per step: TP 4 collectives per layer and micro-batch of b*s*h values (inside a
node); PP 2 point-to-point messages per stage boundary and micro-batch of b*s*h/(tp if SP); DP
one all-reduce of the stage's gradients (2 (dp-1)/dp x its bytes; ZeRO-1 the same in
reduce-scatter + all-gather form). ZeRO-2 (pp = 1; `ShardedOptimizer(stage=2)` over dp x cp)
keeps only its shard of the gradients (and of the optimizer state: both / (dp cp)), so it
reduce-scatters after *every* micro-batch's backward (m (dp-1)/dp x the bytes for m
micro-batches; DeepSpeed issue #2252) and all-gathers the updated shards once. SP's sum over
TP of a replicated weight's gradient (a hook on the parameter) runs before each backward's
reduce-scatter, once: the TP sum of dp-averaged shards is the dp average of the TP sums.

    mesh = ctx.mesh(dp=2, tp=2, pp=2, cp=2)     # cp: x, target sharded along the sequence
    hybrid = HybridParallel(model, mesh, loss_fn, tp_plan=plan, n_microbatches=4,
                            cp_layout="zigzag")
    optimizers = [Adam(params) for params, group in hybrid.gradient_groups]
    loss = hybrid.forward_backward(x, y)    # the pipeline: every micro-batch's fwd and bwd
    hybrid.sync_gradients()                 # the DP (x CP) average, EP's replica sums
    for opt in optimizers: opt.step()

Serving composes the same blocks (`HybridGenerator`, labkit.parallel.serving's idea): the
requests split over the replicas (dp), the model split by TP, its MoE layers spread over EP
(attention replicated) or its layers cut into pp stages run by `PipelineGenerator`.
"""
import torch
import torch.nn as nn

from ..runtime.context import context
from .moe import ExpertParallel
from . import pipeline
from .pipeline import PipelineSchedule, PipelineStage, split_into_stages
from .serving import PipelineGenerator, generate, new_cache, split_requests
from .flat import average_gradients, unwrapped_name
from .context_parallelism import ContextParallel
from .fully_shard import FullyShard, one_unit_per_layer
from .recompute import CheckpointedLayer, checkpoint_attention_cores
from .mesh_dims import (SCHEDULES, check_layout, dp_cp_group, dp_groups, ep_dp_cp_group,
                        ep_shard_group, validate_dims)
from .tp_shards import all_gather_dim, split_parts
from .parallel_styles import parallelize_module
from .tensor_parallel import gather_params
from .tensor_parallel_plan import plan_for


def pipeline_schedule(stages, n_microbatches, loss_fn, schedule, recompute=False):
    """torch's class for a schedule torch names (Schedule1F1B, ...), else labkit's executor
    running the name ("naive") or the schedule's data."""
    if isinstance(schedule, str) and schedule in pipeline.TORCH_NAMES:
        torch_class = getattr(pipeline, pipeline.TORCH_NAMES[schedule])
        return torch_class(stages, n_microbatches, loss_fn, recompute=recompute)
    return PipelineSchedule(stages, n_microbatches, loss_fn, schedule=schedule,
                            recompute=recompute)


def moe_layers(module):
    """(parent, attribute, layer) of every Mixture-of-Experts layer: a router and experts."""
    found = []
    for name, child in module.named_modules():
        for attr, layer in child.named_children():
            if hasattr(layer, "experts") and (hasattr(layer, "router") or hasattr(layer, "gate")):
                found.append((child, attr, layer))
    return found


def attention_layers(module):
    """(parent, attribute, layer) of every attention layer (a module whose class is named
    *Attention*, outermost): those ContextParallel wraps."""
    found = []
    for child in module.modules():
        for attr, layer in child.named_children():
            if "attention" in type(layer).__name__.lower() and not any(
                    layer is inner for _, _, outer in found for inner in outer.modules()):
                found.append((child, attr, layer))
    return found


def shard_experts(expert_parallel: ExpertParallel, group) -> FullyShard:
    """ZeRO-3 of one ExpertParallel's local experts over `group`: the ranks holding the same
    experts (their replicas, never ranks of its EP group, whose experts differ; torchtitan's
    fully_shard of the experts over its dp_shard_mod_ep mesh). One FullyShard unit per
    expert, in `experts`' place; the gradients are reduce-scattered and averaged over `group`.
    Wrap the enclosing block in FullyShard after this, not before."""
    experts = expert_parallel.module.experts
    sharded = FullyShard(experts, group, units=lambda m: any(m is e for e in experts.values()))
    expert_parallel.use_sharded_experts(sharded, sharded.compute_parameters())
    return sharded


def check_recompute(recompute, k=None, virtual=1, zero_stage=0):
    """recompute as "none" | "full" | "selective" (False / True accepted), or a one-line
    ValueError naming the argument; k (recompute_layers): full recompute of k of each rank's
    blocks (None: the pipeline's whole stages)."""
    mode = {False: "none", True: "full"}.get(recompute, recompute) \
        if isinstance(recompute, (bool, str)) else recompute
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"recompute must be 'none', 'full' or 'selective' (or False / "
                         f"True), got {recompute!r}")
    if k is None:
        return mode
    if mode != "full" or not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"recompute_layers must be a whole number >= 0 with recompute='full' "
                         f"(k of each stage's layers), got {k!r} with recompute={mode!r}")
    if virtual > 1:
        raise ValueError("recompute_layers with virtual > 1: the mesh checkpoints a rank's "
                         "first k blocks, not k per interleaved chunk; use recompute_layers=None")
    if zero_stage == 3:
        raise ValueError("recompute_layers with zero_stage=3: not composed (FullyShard's "
                         "per-layer units around checkpointed blocks); use recompute_layers=None")
    return mode


class HybridParallel:
    """`model` (an nn.Sequential, or a model with `as_sequential()`) composed on a `mesh`.

    loss_fn(output, target) on the last stage; tp_plan: `parallelize_module`'s string plan on
    the sequential (e.g. {"*.attn.qkv": "colwise", ...}); schedule / n_microbatches / virtual:
    the pipeline's; expert_parallel: wrap every MoE layer in ExpertParallel over mesh["ep"];
    zero_stage 0, 1 or 2 (the modules as they are: ZeRO-1/2 is the optimizer's, a
    ShardedOptimizer over each of `gradient_groups`; ZeRO-2's reduce-scatters the gradients
    itself, after each micro-batch; pp = 1, no experts) or 3 (each stage in FullyShard over
    `dp_shard`; `dp_replicate` > 1: HSDP, the shards' gradients averaged over `dp_replicate`). mesh
    cp > 1: every attention layer in ContextParallel over mesh["cp"]
    (`cp_layout`, `cp_method`: its layout and core); x and target are this rank's sequence
    shards. recompute: "none" (False), "full" (True: the pipeline's, each stage keeps only its
    input per micro-batch in flight and runs its forward again in backward) or "selective"
    (each attention layer's core checkpointed, parallel/recompute.py: 34 sbh kept per layer
    where none keeps 34 sbh + 5 a s^2 b; Korthikanti et al. 2022, arXiv 2205.05198). After
    construction: `dp_shard` / `dp_replicate` (the groups; None where there is no such
    dimension; dp_shard spans cp), `dp_cp` (the group averaging the gradients under
    ZeRO-0/1), `ep_dp` (the group of the experts' replicas), `ep_shard` (ZeRO-3 with experts:
    the group FullyShard shards them over), `stage_params` (this rank's stages' parameters
    after TP, before FullyShard shards them) and `expert_params` (of them its experts').
    """

    def __init__(self, model, mesh, loss_fn, *, tp_plan=None, sequence_parallel=False,
                 schedule="1f1b", n_microbatches=4, virtual=1, balance="layers",
                 expert_parallel=False, zero_stage=0, dp_replicate=1, cp_layout="zigzag",
                 cp_method="ring", recompute=False, recompute_layers=None):
        if not hasattr(mesh, "sizes"):
            raise TypeError(f"HybridParallel: mesh must be a labkit Mesh (ctx.mesh(dp=..., "
                            f"tp=..., pp=...)), got {type(mesh).__name__} {mesh!r:.40}")
        cp = mesh.sizes["cp"]
        mode = check_recompute(recompute, recompute_layers, virtual, zero_stage)
        validate_dims(dp=mesh.sizes["dp"], tp=mesh.sizes["tp"], pp=mesh.sizes["pp"], cp=cp,
                      ep=mesh.ep, dp_replicate=dp_replicate, zero_stage=zero_stage,
                      sequence_parallel=sequence_parallel and mesh.sizes["tp"] > 1,
                      experts=int(bool(expert_parallel)), cp_layout=cp_layout)
        self.ctx, self.mesh, self.zero_stage = context(), mesh, zero_stage
        self.dp_shard, self.dp_replicate = (dp_groups(mesh, dp_replicate) if zero_stage == 3
                                            else (None, None))
        # the ranks whose gradients are averaged (ZeRO-0/1): dp x cp (mesh["dp"] if cp = 1)
        self.dp_cp = dp_cp_group(mesh)
        # the replicas of this rank's experts: dp x cp / ep ranks (mesh["ep_dp"] if cp = 1)
        self.ep_dp = ep_dp_cp_group(mesh) if expert_parallel else mesh["ep_dp"]
        # ZeRO-3 shards the experts over their replicas within one dp_shard group
        self.ep_shard = None if zero_stage != 3 or not expert_parallel else \
            self.ep_dp if dp_replicate == 1 else ep_shard_group(mesh, dp_replicate)
        if cp > 1 and not attention_layers(model):
            raise ValueError(f"cp={cp} but the {type(model).__name__} has no module named "
                             "*Attention* to make context-parallel")
        if mode == "selective" and not attention_layers(model):
            raise ValueError(f"recompute='selective' but the {type(model).__name__} has no "
                             "module named *Attention* whose core to recompute: use 'full'")
        self.recompute, self.recompute_layers = mode, recompute_layers
        blocks_left = recompute_layers or 0   # full recompute of this rank's first k blocks
        pp = mesh.sizes["pp"]
        total = pp * virtual
        modules = split_into_stages(model, total, balance)
        mine = list(range(mesh.coords["pp"], total, pp))
        self._tp_splits = {}   # stage -> {name: (tp_split, tp_group)}: FullyShard hides them
        self.stage_params = 0  # this rank's parameters after TP, before FullyShard
        self._sp_sum = []      # ZeRO-3 + SP: shards whose gradient is summed over TP
        self.expert_params = 0   # of them, this rank's experts'
        for s in mine:
            if mesh.sizes["tp"] > 1 and tp_plan:
                parallelize_module(modules[s], mesh["tp"], plan_for(modules[s], tp_plan),
                                   sequence_parallel=sequence_parallel)
            attention = []   # each attention layer as it sits in the stage (CP-wrapped)
            for parent, attr, layer in attention_layers(modules[s]):
                if cp > 1:   # after TP (the attention sees this rank's heads), before FSDP
                    setattr(parent, attr, ContextParallel(layer, mesh["cp"], cp_layout,
                                                          cp_method))
                attention.append(getattr(parent, attr))
            if mode == "selective" and attention:
                # on the CP wrapper, under its router: the ring keeps no scores and refuses a
                # hand-written core itself, so only a plain layer must show its core call
                checkpoint_attention_cores(attention, type(model).__name__, require_core=cp == 1)
            if expert_parallel:   # tp > 1: each expert split over TP too (expert_tp.py)
                tp_group = mesh["tp"] if mesh.sizes["tp"] > 1 and tp_plan else None
                for parent, attr, layer in moe_layers(modules[s]):
                    setattr(parent, attr, ExpertParallel(
                        layer, group=mesh["ep"], tp_group=tp_group,
                        sequence_parallel=sequence_parallel))
            for i, unit in enumerate(modules[s]):   # the blocks: units holding attention
                if blocks_left and attention_layers(unit):
                    modules[s][i], blocks_left = CheckpointedLayer(unit), blocks_left - 1
            self.stage_params += sum(p.numel() for p in modules[s].parameters())
            self.expert_params += sum(p.numel() for _, _, layer in moe_layers(modules[s])
                                      for p in layer.experts.parameters())
            if zero_stage == 3:   # last, on the TP shards: torchtitan's order
                named = dict(modules[s].named_parameters())
                self._tp_splits[s] = {unwrapped_name(n): (getattr(p, "tp_split", None),
                                                          getattr(p, "tp_group", None))
                                      for n, p in named.items()}
                # the experts first, over their own replicas; then the stage over dp_shard
                for wrapper in modules[s].modules():
                    if isinstance(wrapper, ExpertParallel):
                        shard_experts(wrapper, self.ep_shard)
                named = dict(modules[s].named_parameters())
                modules[s] = FullyShard(modules[s], group=self.dp_shard,
                                        units=one_unit_per_layer(modules[s]))
                # SP's replicated weights lose their TP-sum hook to FullyShard's leaves:
                # their shards' gradients are summed over TP after the pipeline instead
                shards = dict(modules[s].module.named_parameters())
                self._sp_sum += [shards[n] for n, p in named.items()
                                 if getattr(p, "_tp_sum", False)]
        self.stages = [PipelineStage(modules[s], s, total, group=mesh["pp"]) for s in mine]
        self.module = nn.ModuleList(stage.module for stage in self.stages)
        self.pipe = pipeline_schedule(self.stages, n_microbatches, loss_fn, schedule,
                                      recompute=mode == "full" and recompute_layers is None)
        params = list(self.module.parameters())
        expert_ids = {id(p) for _, _, layer in moe_layers(self.module)
                      for p in layer.experts.parameters()}
        self.dense = [p for p in params if p.requires_grad and id(p) not in expert_ids]
        self.experts = [p for p in params if p.requires_grad and id(p) in expert_ids]

    @property
    def is_last(self):
        return any(stage.is_last for stage in self.stages)

    @property
    def gradient_groups(self):
        """[(parameters, the group their gradients are averaged over)]: the dense ones over
        dp x cp (`dp_cp`; ZeRO-3: FullyShard's shards), the experts over `ep_dp` (their
        replicas, dp x cp / ep ranks). What the optimizers are built from, one per group
        (ZeRO-1 shards each over its group)."""
        return [(params, group) for params, group in ((self.dense, self.dp_cp),
                                                      (self.experts, self.ep_dp))
                if params]

    def forward_backward(self, x=None, target=None):
        """The pipeline's forward and backward of every micro-batch (x on the first stage,
        target on the last); returns the mean loss on the last stage's ranks, else None."""
        losses = []   # torch's step returns the outputs; the last stage reports the mean loss
        self.pipe.step(x, target=target, losses=losses)
        return torch.stack(losses).mean() if losses else None

    def sync_gradients(self):
        """After backward: each gradient averaged over the ranks holding its parameter (ZeRO-2:
        already done, each micro-batch's by ShardedOptimizer(stage=2)'s reduce-scatter)."""
        if self.zero_stage == 3:   # FullyShard averaged over dp_shard (experts: ep_shard)
            self._sum_over_tp(self._sp_sum)
            if self.dp_replicate is not None:   # HSDP: across replicas, experts' shards too
                average_gradients(self.dense + self.experts, self.dp_replicate,
                                  tag="dp_replicate grads")
            return
        if self.zero_stage != 2:   # DP (x CP): a stage's replicas average (one all-reduce)
            average_gradients(self.dense, self.dp_cp,
                              tag="dp_cp grads" if self.mesh.sizes["cp"] > 1 else "dp grads")
        average_gradients(self.experts, self.ep_dp, tag="ep_dp grads")

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
            split, group = splits[unwrapped_name(name)]
            if split is not None:
                dim, parts = split
                tensor = torch.cat([all_gather_dim(p, dim, group, "gather params")
                                    for p in split_parts(tensor, dim, parts, group.size)],
                                   dim=dim)
            out[name] = tensor
        return out


class HybridGenerator:
    """Greedy generation of `model` (a TinyGPT-shaped module with `cfg.hidden`) on a `mesh`.

    tp > 1: split by `parallelize_module(model, mesh["tp"], tp_plan)` (each rank caches its own
    heads); expert_parallel and ep > 1: every MoE layer in ExpertParallel over mesh["ep"];
    pp > 1: cut into pp stages by layers, run by `PipelineGenerator` (the requests in pp
    micro-batches). Each dp rank (replicas x ep) generates its share of the requests. After
    `generate`: `cache_bytes` (this rank's KV cache), `held` (the module this rank serves
    with: its stage, or the whole model), `requests_here`.
    """

    def __init__(self, model, mesh, tp_plan=None, expert_parallel=False):
        self.model, self.mesh = model, mesh
        if mesh.sizes["tp"] > 1:
            parallelize_module(model, mesh["tp"], tp_plan)
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
