"""ZeRO: data parallelism without the redundancy - each rank keeps 1/N of the model states.

Every rank still trains on its slice of the batch, but instead of N full copies of weights,
gradients and optimizer state, the states are cut into N equal shards (Rajbhandari et al. 2020,
arXiv 1910.02054). Bytes per rank with Ψ parameters and K bytes of optimizer state per parameter
(K = 12 for mixed-precision Adam: fp32 master + momentum + variance; K = 8 for fp32 Adam):

    baseline (2+2+K)Ψ   stage 1 2Ψ + 2Ψ + KΨ/N   stage 2 2Ψ + (2+K)Ψ/N   stage 3 (2+2+K)Ψ/N

(the 2s are 4s in fp32 mode). Communication per step and rank: stages 1 and 2 reduce-scatter the
gradients (Ψ) and all-gather the updated weights (Ψ): 2Ψ, the same as DP's all-reduce. Stage 3
all-gathers each layer before its forward and again before its backward: 3Ψ, 1.5x DP.

How it is laid out here, top to bottom:
- `FlatUnit`: one layer's parameters in one flat buffer, padded to a multiple of N so the N
  shards are equal; rank r owns elements [r*S, (r+1)*S). The module's parameters are views into
  that buffer, so the model runs unchanged.
- `GradReducer`: post-accumulate-grad hooks; when a layer's gradients are complete its async
  reduce-scatter starts (one bucket per layer), overlapping the rest of backward. Stage 1 keeps
  the full gradient buffer; stages 2 and 3 free it as soon as it is reduced.
- `ParamGatherer` (stage 3): a forward pre-hook all-gathers a layer's weights just before its
  forward, and a pass-through autograd function gathers them again just before its backward;
  the next layer is prefetched one ahead (async); storage is freed (resized to 0) after use.
- `train(ctx, cfg, stage, ...)`, `reference_mixed_precision(cfg)`, `predict_memory`,
  `comm_plan`, `add_arguments` / `report` for `python -m labkit run zero --stage S`.
"""
import math

import torch
import torch.nn as nn

from . import data
from .runs.reference import RunConfig, batch, build_model, build_optimizer
from .runtime.memory import optimizer_state_tensors
from .runs.report import build_report, rank_result
from .theory import hardware
from .theory import memory as theory_memory
from .theory import time as theory_time

STAGES = (1, 2, 3)
GRAD_SYNCS = ("reduce_scatter", "all_reduce")
COMPUTE_DTYPE = torch.bfloat16   # weights and gradients under --mixed-precision
OFFLOAD_LINK = "PCIe5"           # host <-> GPU link that ZeRO-Offload's copies cross


# ------------------------------------------------------------------------------ the flat layout

def layer_units(model):
    """The model cut into layers, in forward order: each child module, each ModuleList entry."""
    units = []
    for name, child in model.named_children():
        members = ([(f"{name}.{i}", m) for i, m in enumerate(child)]
                   if isinstance(child, nn.ModuleList) else [(name, child)])
        units += [(n, m) for n, m in members if any(True for _ in m.parameters())]
    covered = sum(p.numel() for _, m in units for p in m.parameters())
    if covered != sum(p.numel() for p in model.parameters()):
        raise ValueError("ZeRO here shards parameters that live in child modules only")
    return units


class FlatUnit:
    """One layer's parameters as one flat buffer, padded so it cuts into N equal shards.

    `full` is the whole (padded) buffer, and every parameter of the module a view into it;
    `shard()` is this rank's contiguous 1/N. Padding adds fewer than N elements per layer.
    """

    def __init__(self, name, module, prefix, rank, world_size, dtype, device):
        self.name, self.module = name, module
        self.params = []     # (full name, parameter, offset, numel)
        offset = 0
        for pname, p in module.named_parameters():
            self.params.append((f"{prefix}{pname}", p, offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        self.padded = math.ceil(offset / world_size) * world_size
        self.shard_numel = self.padded // world_size
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.full = torch.zeros(self.padded, dtype=dtype, device=device)
        with torch.no_grad():
            for _, p, off, n in self.params:
                self.full[off:off + n].copy_(p.detach().reshape(-1))
                p.data = self.full[off:off + n].view_as(p)   # the module now uses the buffer
        self.nbytes = self.full.nbytes
        self.sharded = None  # stage 3: this rank's own copy of its shard (the full is freed)
        self.grad_full = None   # stage 1: the persistent full gradient buffer
        self.grad_shard = None  # this rank's reduced gradient shard
        self.master = None      # mixed precision: fp32 master copy of the shard

    def shard(self):
        """This rank's slice of the weights (stage 3: its own tensor, the full being freed)."""
        return self.sharded if self.sharded is not None else self.full[self.lo:self.hi]

    # stage 3: the full buffer's storage comes and goes; the parameter views stay valid
    def free(self):
        self.full.untyped_storage().resize_(0)

    def allocate(self):
        if self.full.untyped_storage().nbytes() == 0:
            self.full.untyped_storage().resize_(self.nbytes)

    @property
    def gathered(self):
        return self.full.untyped_storage().nbytes() > 0


def _slot(flat, offset, numel, like):
    return flat[offset:offset + numel].view_as(like)


# -------------------------------------------------------------------------- gradient reduction

class GradReducer:
    """Reduce each layer's gradients as soon as backward has produced all of them.

    stage 1: `p.grad` are views into one persistent flat buffer per layer (autograd adds into
    them in place); the buffer is reduce-scattered (or all-reduced) and kept whole.
    stages 2 and 3: autograd's `p.grad` is copied into a transient bucket and dropped at once;
    the bucket's reduce-scatter runs async; when it lands only the 1/N shard is kept.
    At most `in_flight` buckets are outstanding, which bounds the transient memory.
    """

    def __init__(self, ctx, units, stage, grad_sync="reduce_scatter", on_unit_done=None,
                 in_flight=2):
        self.ctx, self.units, self.stage, self.grad_sync = ctx, units, stage, grad_sync
        self.on_unit_done, self.in_flight = on_unit_done, in_flight
        self.unit_of, self.arrived, self.buckets, self.pending = {}, {}, {}, []
        for unit in units:
            for _, p, off, n in unit.params:
                self.unit_of[p] = (unit, off, n)
                p.register_post_accumulate_grad_hook(self._on_grad)
            if stage == 1:
                unit.grad_full = torch.zeros_like(unit.full)

    def start_step(self):
        self.arrived = {unit.name: 0 for unit in self.units}
        self.issued = set()
        for unit in self.units:
            unit.grad_shard = None
            if self.stage == 1:   # fresh zeros each step; the views make autograd add into them
                unit.grad_full.zero_()
                for _, p, off, n in unit.params:
                    p.grad = _slot(unit.grad_full, off, n, p)

    def _on_grad(self, p):
        unit, off, n = self.unit_of[p]
        if self.stage != 1:
            bucket = self.buckets.get(unit.name)
            if bucket is None:   # zeros: the padding (and any unused parameter) reduces 0
                bucket = self.buckets[unit.name] = torch.zeros_like(unit.full)
                self.ctx.memory.add_buffer(f"grad bucket {unit.name}", bucket)
            bucket[off:off + n].copy_(p.grad.reshape(-1))
            p.grad = None   # the full gradient lives only until its bucket is reduced
        self.arrived[unit.name] += 1
        if self.arrived[unit.name] == len(unit.params):
            self._issue(unit)

    def _issue(self, unit):
        comm = self.ctx.comm
        comm.tag = f"grads {unit.name}"
        if self.stage == 1:
            flat = unit.grad_full
        else:
            flat = self.buckets.get(unit.name)
            if flat is None:   # no parameter of this layer got a gradient this step
                flat = self.buckets[unit.name] = torch.zeros_like(unit.full)
        if self.grad_sync == "all_reduce":
            handle = comm.all_reduce(flat, op="avg", async_op=True)
        else:
            handle = comm.reduce_scatter(flat, op="avg", async_op=True)
        comm.tag = ""
        self.issued.add(unit.name)
        self.pending.append((unit, handle))
        if self.on_unit_done is not None:
            self.on_unit_done(unit)
        while len(self.pending) > self.in_flight:
            self._land(*self.pending.pop(0))

    def _land(self, unit, handle):
        reduced = handle.wait()
        if self.stage == 1:
            if self.grad_sync == "reduce_scatter":   # keep the reduced shard in its place
                unit.grad_full[unit.lo:unit.hi].copy_(reduced)
            unit.grad_shard = unit.grad_full[unit.lo:unit.hi]
        else:
            unit.grad_shard = reduced
            self.buckets.pop(unit.name, None)
            self.ctx.memory.remove_buffer(f"grad bucket {unit.name}")

    def finish(self):
        """After backward: issue what never completed, wait for every bucket."""
        for unit in reversed(self.units):
            if unit.name not in self.issued:
                self._issue(unit)
        while self.pending:
            self._land(*self.pending.pop(0))


# ------------------------------------------------------------------ stage 3: gather, use, free

class _GatherBeforeBackward(torch.autograd.Function):
    """Identity in forward; in backward it first has the layer's weights gathered again."""

    @staticmethod
    def forward(ctx, gatherer, index, x):
        ctx.gatherer, ctx.index = gatherer, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.gatherer.before_backward(ctx.index)
        return None, None, grad


class ParamGatherer:
    """Stage 3: a layer's full weights exist only while it computes (forward, then backward).

    Forward pre-hook: wait for (or issue) the gather of layer i, issue the prefetch of layer
    i+1. Forward post-hook: free layer i, and wrap its output so that backward reaches
    `before_backward(i)` first, which gathers layer i again and prefetches layer i-1. The
    reducer calls `release` when layer i's gradients are complete. Every rank runs the same
    graph, so every rank issues the same collectives in the same order.
    """

    def __init__(self, ctx, units, prefetch=True):
        self.ctx, self.units, self.prefetch = ctx, units, prefetch
        self.inflight = {}   # unit index -> async all_gather handle
        for i, unit in enumerate(units):
            unit.module.register_forward_pre_hook(lambda m, args, i=i: self.before_forward(i))
            unit.module.register_forward_hook(lambda m, args, out, i=i: self.after_forward(i, out))

    def _issue(self, i, async_op):
        unit = self.units[i]
        self.ctx.comm.tag = f"params {unit.name}"
        handle = self.ctx.comm.all_gather(unit.shard(), async_op=async_op)
        self.ctx.comm.tag = ""
        if not async_op:
            return handle
        self.inflight[i] = handle
        self.ctx.memory.add_buffer(f"prefetch {unit.name}", handle.result)
        return None

    def ensure(self, i):
        unit = self.units[i]
        if unit.gathered:
            return
        handle = self.inflight.pop(i, None)
        gathered = self._issue(i, async_op=False) if handle is None else handle.wait()
        self.ctx.memory.remove_buffer(f"prefetch {unit.name}")
        unit.allocate()
        unit.full.copy_(gathered)
        del gathered, handle
        _not_an_activation(self.ctx, unit.full, True)
        self.ctx.memory.add_buffer(f"gathered {unit.name}", unit.full)

    def _prefetch(self, i):
        if self.prefetch and 0 <= i < len(self.units) and i not in self.inflight \
                and not self.units[i].gathered:
            self._issue(i, async_op=True)

    def release(self, i):
        unit = self.units[i]
        if not unit.gathered:
            return
        _not_an_activation(self.ctx, unit.full, False)
        unit.free()
        self.ctx.memory.remove_buffer(f"gathered {unit.name}")

    def before_forward(self, i):
        self.ensure(i)
        self._prefetch(i + 1)

    def after_forward(self, i, out):
        self.release(i)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            return _GatherBeforeBackward.apply(self, i, out)
        return out

    def before_backward(self, i):
        self.ensure(i)
        self._prefetch(i - 1)

    def release_all(self):
        for i in list(self.inflight):       # a prefetch nobody used still has to land
            self.ensure(i)
        for i in range(len(self.units)):
            self.release(i)


def _not_an_activation(ctx, tensor, add):
    """Gathered weights that forward saves for backward are parameters, not activations.

    The memory tracker excludes the parameter storages it sees when tracking starts; stage 3's
    buffers appear later, so they are added (and removed) here.
    """
    if add:
        ctx.memory.exclude(tensor)
    else:
        ctx.memory.include(tensor)


# ------------------------------------------------------------------------------------- training

def train(ctx, cfg=None, stage=1, mixed_precision=False, offload=False,
          grad_sync="reduce_scatter", prefetch=True, step_callback=None):
    """ZeRO training on this rank; returns `rank_result` with the gathered params on rank 0.

    fp32 mode: fp32 weights and grads, Adam moments sharded (K = 8). mixed_precision: bf16
    weights and grads for compute, fp32 master weights + moments sharded (K = 12); compare it
    with `reference_mixed_precision`, not with the fp32 reference. offload: the optimizer
    state lives in host memory (not counted on the device) and the modelled clock pays the
    PCIe copies of the gradient shard down and of the updated weight shard up.
    `step_callback(step)`, if given, runs after each step (benchmarks time steps with it).
    """
    cfg = cfg or RunConfig()
    if stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if grad_sync not in GRAD_SYNCS:
        raise ValueError(f"grad_sync must be one of {GRAD_SYNCS}, got {grad_sync!r}")
    if stage > 1 and grad_sync != "reduce_scatter":
        raise ValueError("stages 2 and 3 keep only a gradient shard: grad_sync='reduce_scatter'")
    n = ctx.world_size
    if cfg.global_batch % n:
        raise ValueError(f"global batch {cfg.global_batch} must split over {n} ranks")
    dtype = COMPUTE_DTYPE if mixed_precision else torch.float32
    model = build_model(cfg).to(device=ctx.device, dtype=dtype)
    units = [FlatUnit(name, module, f"{name}.", ctx.rank, n, dtype, ctx.device)
             for name, module in layer_units(model)]

    # What the optimizer steps: this rank's shards (fp32 masters under mixed precision).
    if stage == 3:
        for unit in units:
            unit.sharded = unit.full[unit.lo:unit.hi].clone()
            unit.free()
    if mixed_precision:
        for unit in units:
            unit.master = unit.shard().detach().float()
    stepped = [unit.master if mixed_precision else unit.shard() for unit in units]
    optimizer = build_optimizer(stepped, cfg)

    gatherer = ParamGatherer(ctx, units, prefetch) if stage == 3 else None
    index = {unit.name: i for i, unit in enumerate(units)}
    reducer = GradReducer(ctx, units, stage, grad_sync,
                          on_unit_done=(lambda u: gatherer.release(index[u.name]))
                          if gatherer else None)
    all_params = [p for unit in units for _, p, _, _ in unit.params]

    def held_params():
        return [unit.shard() for unit in units] if stage == 3 else [u.full for u in units]

    def held_grads():
        full = [u.grad_full for u in units] if stage == 1 else [u.grad_shard for u in units]
        return full + [p.grad for p in all_params] + [t.grad for t in stepped]

    def optimizer_tensors():   # fp32 masters (mixed precision) and the Adam moments
        masters = [u.master for u in units] if mixed_precision else []
        return masters + list(optimizer_state_tensors(optimizer))

    def held_optimizer_state():   # under offload they live in host memory, not on the device
        return [] if offload else optimizer_tensors()

    ctx.memory.watch(params=held_params, grads=held_grads, optimizer_state=held_optimizer_state)
    pcie = hardware.link(OFFLOAD_LINK)
    losses, step_samples = [], []
    for step in range(cfg.steps):
        first_sample = len(ctx.memory.samples)
        x, y = batch(model, cfg, step)
        x, y = (_compute_input(data.shard(t, ctx.rank, n), dtype, ctx.device) for t in (x, y))
        reducer.start_step()
        with ctx.memory.track_activations():
            with ctx.clock.compute("forward"):
                loss = model(x, y)
            ctx.memory.sample("after forward")
            with ctx.clock.compute("backward"):
                loss.backward()
        reducer.finish()
        if gatherer is not None:
            gatherer.release_all()
        ctx.memory.sample("after backward")

        shard_bytes = sum(u.shard_numel for u in units) * units[0].full.element_size()
        if offload:
            ctx.clock.advance(_pcie_time(pcie, shard_bytes), kind="comm",
                              name="offload: gradient shard to host (PCIe, modelled)")
        for unit, tensor in zip(units, stepped):
            tensor.grad = unit.grad_shard.float() if mixed_precision else unit.grad_shard
        ctx.memory.sample("before optimizer step")
        with ctx.clock.compute("optimizer step (host)" if offload else "optimizer step"):
            optimizer.step()
        for unit, tensor in zip(units, stepped):
            tensor.grad = None
            if mixed_precision:   # the bf16 working copy of my shard from the fp32 master
                unit.shard().copy_(unit.master)
        if offload:
            ctx.clock.advance(_pcie_time(pcie, shard_bytes), kind="comm",
                              name="offload: weight shard to GPU (PCIe, modelled)")
        if stage < 3:
            all_gather_updated_params(ctx, units)
        ctx.memory.sample(f"after step {step}")
        ctx.clock.mark_step()
        ctx.progress(step + 1, cfg.steps)
        losses.append(loss.item())
        step_samples = ctx.memory.samples[first_sample:]
        if step_callback is not None:
            step_callback(step)

    params = gather_full_params(ctx, units, mixed_precision)
    offloaded = sum(t.nbytes for t in optimizer_tensors()) if offload else 0
    return rank_result(ctx, losses, params=params if ctx.rank == 0 else None, local_loss=losses,
                       step_memory=[(phase, snap) for phase, snap in step_samples],
                       padded_numel=sum(u.padded for u in units),
                       unit_numels=[u.numel for u in units],
                       offloaded_bytes=offloaded)


def _compute_input(t, dtype, device):
    t = t.to(device)
    return t.to(dtype) if t.is_floating_point() else t


def _pcie_time(link, nbytes):
    return link.latency + nbytes / link.effective_bandwidth


def all_gather_updated_params(ctx, units):
    """Stages 1 and 2: every rank updated its shard; gather them back into the full weights.

    All layers' gathers are issued at once (async) and copied in as they land, so their
    latencies overlap instead of adding up.
    """
    handles = []
    for unit in units:
        ctx.comm.tag = f"params {unit.name}"
        handles.append(ctx.comm.all_gather(unit.shard(), async_op=True))
        ctx.memory.add_buffer(f"param all-gather {unit.name}", handles[-1].result)
    ctx.comm.tag = ""
    for unit, handle in zip(units, handles):
        unit.full.copy_(handle.wait())
        ctx.memory.remove_buffer(f"param all-gather {unit.name}")
    del handles


def gather_full_params(ctx, units, mixed_precision):
    """{name: full tensor} for the report (fp32 masters under mixed precision).

    Not part of training: run with the clock off and dropped from the comm log, so the log
    holds exactly the training steps' traffic.
    """
    kept, ctx.clock.enabled = list(ctx.comm.records), False
    out = {}
    for unit in units:
        source = unit.master if mixed_precision else unit.shard()
        full = ctx.comm.all_gather(source.detach())
        for name, p, off, numel in unit.params:
            out[name] = full[off:off + numel].view(p.shape).clone().cpu()
    ctx.comm.records[:] = kept
    ctx.clock.enabled = True
    return out


def global_loss(results):
    """The full-batch loss per step: the mean over ranks of each rank's shard loss."""
    per_rank = [r["local_loss"] for r in results]
    return [sum(step) / len(step) for step in zip(*per_rank)]


# --------------------------------------------------------- the mixed-precision single device

def reference_mixed_precision(cfg=None):
    """One device, full batch, the same mixed-precision algorithm ZeRO runs sharded:
    bf16 weights and gradients for compute, Adam on fp32 master weights, bf16 copy back.

    With N = 1 ZeRO matches it bit for bit; with N > 1 the bf16 gradient average differs in
    rounding from the full-batch bf16 gradient, so compare with a looser tolerance.
    """
    cfg = cfg or RunConfig()
    model = build_model(cfg).to(COMPUTE_DTYPE)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]
    optimizer = build_optimizer(masters, cfg)
    losses = []
    for step in range(cfg.steps):
        x, y = (_compute_input(t, COMPUTE_DTYPE, "cpu") for t in batch(model, cfg, step))
        for p in params:
            p.grad = None
        loss = model(x, y)
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        losses.append(loss.item())
    names = [name for name, _ in model.named_parameters()]
    return dict(loss=losses, params={k: m.clone() for k, m in zip(names, masters)})


# ---------------------------------------------------------------------------- theory / predictions

def param_count(cfg):
    return sum(p.numel() for p in build_model(cfg).parameters())


def predict_memory(cfg, world_size, stage, mixed_precision=False, offload=False):
    """Bytes per rank from theory.memory.model_state_bytes (the ZeRO paper's formulas) plus
    activations for global_batch/N examples; offload moves the optimizer state to the host.
    Stage 3's buffers: one gathered layer plus one prefetched (the two largest layers)."""
    from .runs.reference import activation_bytes
    model = build_model(cfg)
    psi = sum(p.numel() for p in model.parameters())
    states = theory_memory.model_state_bytes(psi, mixed_precision=mixed_precision,
                                             optimizer=cfg.optimizer, zero_stage=stage,
                                             world_size=world_size)
    out = {k: states[k] for k in ("params", "grads", "optimizer")}
    if offload:
        out["optimizer"] = 0.0
    out["activations"] = activation_bytes(model, cfg.global_batch // world_size) \
        * (0.5 if mixed_precision else 1.0)
    w = 2 if mixed_precision else 4
    largest = sorted(sum(p.numel() for p in m.parameters()) for _, m in layer_units(model))
    out["buffers"] = w * sum(largest[-2:]) if stage == 3 and world_size > 1 else 0.0
    out["peak"] = sum(out[k] for k in ("params", "grads", "optimizer", "activations",
                                       "buffers"))
    return out


def comm_plan(unit_numels, world_size, stage, elem_bytes, grad_sync="reduce_scatter"):
    """The collectives of one step as (op, payload bytes this rank hands in), per layer.

    Gradients: reduce-scatter of the padded layer (or all-reduce, stage 1's DeepSpeed-v1
    variant). Weights: all-gather of the 1/N shard after the step (stages 1, 2) or before each
    layer's forward and backward (stage 3).
    """
    n = world_size
    ops = []
    for numel in unit_numels:
        padded = math.ceil(numel / n) * n
        ops.append((grad_sync, padded * elem_bytes))
        gathers = 2 if stage == 3 else 1
        ops += [("all_gather", padded // n * elem_bytes)] * gathers
    return ops


def predicted_wire_bytes(unit_numels, world_size, stage, elem_bytes,
                         grad_sync="reduce_scatter"):
    """Wire bytes per rank and step of `comm_plan` (theory.time.wire_bytes_per_rank)."""
    return sum(theory_time.wire_bytes_per_rank(op, nbytes, world_size)
               for op, nbytes in comm_plan(unit_numels, world_size, stage, elem_bytes,
                                           grad_sync))


def formula_wire_bytes(psi, world_size, stage, elem_bytes, grad_sync="reduce_scatter"):
    """The paper's per-rank volume, ring algorithm: (N-1)/N x {2, 3}Ψ elements x bytes.

    2 for stages 1 and 2 (= DP's all-reduce), 3 for stage 3 and for stage 1 with all-reduce.
    """
    n = world_size
    factor = 3 if stage == 3 or grad_sync == "all_reduce" else 2
    return factor * (n - 1) / n * psi * elem_bytes


# ------------------------------------------------------------------------------ CLI and report

def add_arguments(parser):
    """Options of `python -m labkit run zero`."""
    parser.add_argument("--stage", type=int, choices=STAGES, default=1,
                        help="1: shard optimizer state, 2: + gradients, 3: + parameters")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="bf16 weights/grads, fp32 master + Adam moments sharded (K=12)")
    parser.add_argument("--offload", action="store_true",
                        help="optimizer state in host memory (ZeRO-Offload), PCIe copies modelled")
    parser.add_argument("--grad-sync", choices=GRAD_SYNCS, default="reduce_scatter",
                        help="stage 1 only: reduce-scatter (2Ψ) or all-reduce (3Ψ)")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="stage 3: gather each layer only when it is needed")


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", stage=1, mixed_precision=False,
           offload=False, grad_sync="reduce_scatter", no_prefetch=False, **_):
    """Run ZeRO training and return the run report of DESIGN.md."""
    from .runtime.launch import launch
    cfg = cfg or RunConfig()
    results = launch(train, world_size, cfg, stage=stage, mixed_precision=mixed_precision,
                     offload=offload, grad_sync=grad_sync, prefetch=not no_prefetch,
                     cluster=cluster)
    results[0] = dict(results[0], loss=global_loss(results))
    elem_bytes = 2 if mixed_precision else 4
    units = results[0]["unit_numels"]
    psi = sum(units)
    reference = reference_mixed_precision(cfg) if mixed_precision else None
    return build_report(
        "zero", cfg, results, reference=reference,
        config=dict(stage=stage, mixed_precision=mixed_precision, offload=offload,
                    grad_sync=grad_sync, prefetch=not no_prefetch, param_count=psi,
                    padded_param_count=results[0]["padded_numel"],
                    reference="mixed-precision single device" if mixed_precision
                    else "fp32 single device"),
        predicted_memory=predict_memory(cfg, world_size, stage, mixed_precision, offload),
        predicted_comm_bytes_per_rank=predicted_wire_bytes(units, world_size, stage, elem_bytes,
                                                           grad_sync) * cfg.steps,
        formula_comm_bytes_per_rank=formula_wire_bytes(psi, world_size, stage, elem_bytes,
                                                       grad_sync) * cfg.steps,
        offloaded_bytes=results[0]["offloaded_bytes"],
        step_memory={r["rank"]: r["step_memory"] for r in results})
