"""ShardedOptimizer: ZeRO stages 1 and 2 - data parallelism without N copies of the optimizer.

In plain data parallelism every rank holds the same weights, gradients and optimizer state and
takes the same optimizer step: N-fold redundancy. ZeRO (Rajbhandari et al. 2020, arXiv
1910.02054) gives each rank about 1/N of the parameters to *own*: it keeps optimizer state for
those only, steps only those, and then sends the updated values to everyone. Bytes per rank
for Psi parameters in 2-byte weights and gradients, K bytes of optimizer state per parameter
(K = 12 for mixed-precision Adam: fp32 master, momentum, variance; 8 for fp32 Adam, 2s are 4s):

    baseline (plain DP)  (2 + 2 + K) Psi
    stage 1  (P_os)      2 Psi + 2 Psi + K Psi / N     optimizer state sharded
    stage 2  (P_os+g)    2 Psi + (2 + K) Psi / N       ... and the gradients too

Communication per step and rank: stage 2 reduce-scatters the gradients (Psi) and all-gathers the
updated weights (Psi): 2 Psi, the same as DP's all-reduce (itself a reduce-scatter plus an
all-gather). Stage 1 here takes gradients already averaged (an all-reduce, 2 Psi, e.g. from
DataParallel) and then sends the owners' weights (Psi): 3 Psi on the wire, as with torch's
ZeroRedundancyOptimizer. Under gradient accumulation (m backwards per step) stage 2 keeps only
its shard, so it reduce-scatters after every backward: (m + 1) Psi per step, where stage 1's
caller reduces the accumulated gradients once (DeepSpeed issue #2252: "For zero stage 2 (and
3), gradient reduction is required after every backward because of gradient partitioning").

How the work is cut:
- stage 1, whole tensors (like torch's ZeroRedundancyOptimizer): parameters go, largest first, to
  the least-loaded rank (balanced within one parameter's size). The inner optimizer steps the
  real parameters it owns, so any optimizer that steps each tensor on its own works, Adafactor's
  factored matrices included (not LBFGS: it couples all tensors); each owner then broadcasts
  its parameters to the group.
- stage 2, flat shards: the trainable parameters are packed, in backward order, into flat buckets
  of about `bucket_mb` MiB (2**20 bytes, as DataParallel's; parameters become views into
  them), each padded to a multiple of N;
  rank r owns slice r of every bucket (exact balance). A post-accumulate-grad hook copies each
  gradient into its bucket and frees it; a complete bucket is reduce-scattered (averaged) while
  backward goes on, and only this rank's slice is kept. The inner optimizer steps the slices
  (views into the buckets), so it must work element by element (SGD, Adam, AdamW, RMSprop,
  Adagrad...); every bucket is then all-gathered. Every rank must produce gradients for the same
  parameters in a backward (as with DDP); gradients accumulate over several backwards.
Frozen parameters are left alone; a tied parameter is one tensor, stepped once.
"""
import weakref
from collections.abc import Iterable

import torch

from ..runtime.comm import GroupLike
from ..runtime.context import context
from ..runtime.memory import optimizer_state_tensors
from .flat import FlatBuffer, all_gather_objects, bucket_params

NOT_ELEMENTWISE = tuple(getattr(torch.optim, name) for name in ("LBFGS", "SparseAdam", "Adafactor")
                        if hasattr(torch.optim, name))


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any `optimizer_class` (~torch's ZeroRedundancyOptimizer).

    `ShardedOptimizer(model.parameters(), torch.optim.AdamW, group=None, stage=1, lr=1e-3)`;
    `params` may be tensors or param-group dicts with their own options, as in torch.
    stage 1: call step() once `.grad` holds gradients averaged over `group` (DataParallel or
    your own all_reduce). stage 2: just `loss.backward(); opt.step()`: the gradients are
    reduce-scattered from backward hooks in buckets of about `bucket_mb` MiB (2**20 B).
    Build it after the model is on its device; the group's ranks must pass the same params.
    Also: `finish_gradient_synchronization()`, `zero_grad()`, `clip_grad_norm_(max_norm)`,
    `consolidate_state_dict(to=0)` + `state_dict()` / `load_state_dict()` in the layout of one
    `optimizer_class` over all the params; `local_part(values)` / `gather_full(local)`: this
    rank's part of per-parameter tensors and back (e.g. MasterWeights' fp32 masters, from
    labkit.parallel.mixed_precision). `ctx.memory` counts what this rank holds: the params,
    the gradients (stage 2: its shards and the bucket in flight), its optimizer state.
    """

    def __init__(self, params: Iterable, optimizer_class: type[torch.optim.Optimizer],
                 group: GroupLike = None, stage: int = 1, *, bucket_mb: float = 25.0,
                 **defaults) -> None:
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r} (stage 3: FullyShard)")
        if stage == 2 and issubclass(optimizer_class, NOT_ELEMENTWISE):
            raise ValueError(f"stage 2 steps flat slices, so it needs an element-wise optimizer;"
                             f" {optimizer_class.__name__} looks at whole tensors: use stage=1")
        self.ctx = context()
        self.group = self.ctx.group(group)
        self.stage, self.optimizer_class = stage, optimizer_class
        self.bucket_bytes = max(1, int(bucket_mb * 2 ** 20))
        self._state = {}
        super().__init__(params, defaults)
        self._trainable = []                    # per param group, tied ones once
        seen = set()
        for g in self.param_groups:
            self._trainable.append([p for p in g["params"] if p.requires_grad
                                    and id(p) not in seen and not seen.add(id(p))])
        self._index = {p: i for i, p in enumerate(p for g in self.param_groups
                                                  for p in g["params"])}
        self.buckets, self._in_flight, self._hooks = [], None, []
        if stage == 1:
            self.owner = self._partition()
            local = [[p for p in ps if self.owner[p] == self.group.rank] for ps in self._trainable]
        else:
            self._build_buckets()
            local = [[b.shard for b in self.buckets if b.group_index == gi]
                     for gi in range(len(self.param_groups))]
        self.optim = optimizer_class([dict(self._options(g), params=ps)
                                      for g, ps in zip(self.param_groups, local)], **defaults)
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            outer.update(self._options(inner))      # show the inner optimizer's own defaults
        self._watch_memory()

    # --- the state torch.optim code looks at is the inner (sharded) optimizer's ----------------
    @property
    def state(self):
        return self.optim.state if "optim" in self.__dict__ else self._state

    @state.setter
    def state(self, value):
        self._state = value

    def add_param_group(self, param_group):
        if "optim" in self.__dict__:
            raise NotImplementedError("ShardedOptimizer: pass every param group when building it")
        super().add_param_group(param_group)

    @staticmethod
    def _options(group):
        return {k: v for k, v in group.items() if k != "params"}

    # --- who owns what ---------------------------------------------------------------------
    def _partition(self):
        """Stage 1: whole tensors, largest first to the least-loaded rank (same on every rank)."""
        load = [0] * self.group.size
        params = [p for ps in self._trainable for p in ps]
        owner = {}
        for p in sorted(params, key=lambda p: -p.numel() * p.element_size()):  # stable sort
            rank = load.index(min(load))
            owner[p] = rank
            load[rank] += p.numel() * p.element_size()
        return owner

    def _build_buckets(self):
        """Stage 2: flat buckets per param group, in backward order, with a hook per parameter.
        A bucket is a FlatBuffer padded to a multiple of N that the parameters become views of;
        `shard` is this rank's slice, `grad` the transient full gradient, `group_index` its
        param group."""
        for gi, params in enumerate(self._trainable):
            for members in bucket_params(params[::-1], self.bucket_bytes, may_exceed=False):
                self._add_bucket(gi, members)

    def _add_bucket(self, group_index, params):
        bucket = FlatBuffer(params, pad_to=self.group.size, index=len(self.buckets))
        bucket.bind()                        # the model computes with the buffer
        bucket.group_index, bucket.grad = group_index, None
        bucket.shard = bucket.part(self.group.rank, self.group.size)
        self.buckets.append(bucket)
        me = weakref.ref(self)
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(
                lambda p, b=bucket: me() and me()._on_grad(b, p)))

    # --- stage 2: gradients reduce-scattered as backward produces them -------------------------
    def _on_grad(self, bucket, p):
        if self._in_flight is not None and self._in_flight[0] is bucket:
            self._land()              # a new backward: the last one's reduction must land first
        if bucket.grad is None:       # zeros: padding, and parameters that got no gradient
            bucket.grad = torch.zeros_like(bucket.data)
        bucket.view(p, bucket.grad).add_(p.grad)  # add: gradients accumulate over backwards
        p.grad = None                 # the full gradient is not kept: only the reduced shard
        bucket.arrived.add(p)
        if bucket.complete:
            self._reduce(bucket)

    def _reduce(self, bucket):
        self._land()                  # at most one bucket in flight bounds the transient bytes
        handle = self.ctx.comm.reduce_scatter(bucket.grad, op="avg", group=self.group,
                                              async_op=True, tag=f"grad bucket {bucket.index}")
        self._in_flight = (bucket, handle)
        bucket.arrived = set()

    def _land(self):
        """Wait for the bucket in flight; add its averaged slice to this rank's shard .grad."""
        if self._in_flight is None:
            return
        bucket, handle = self._in_flight
        shard_grad = handle.wait()
        if bucket.shard.grad is None:
            bucket.shard.grad = shard_grad
        else:
            bucket.shard.grad.add_(shard_grad)
        bucket.grad, self._in_flight = None, None   # free the full gradient buffer

    def finish_gradient_synchronization(self):
        """Stage 2: reduce what backward left (buckets with unused parameters) and wait, so each
        shard's `.grad` holds its averaged gradient. step() calls it; stage 1: nothing to do."""
        for bucket in self.buckets:
            if bucket.grad is not None and (self._in_flight is None
                                            or self._in_flight[0] is not bucket):
                self._reduce(bucket)
        self._land()

    # --- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Step the parameters this rank owns, then bring every rank's parameters up to date."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_gradient_synchronization()
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update(self._options(outer))   # e.g. an LR scheduler changed lr
        self.optim.step()
        if self.stage == 1:
            self._broadcast_owned()
        else:
            self._gather_buckets()
        return loss

    def _broadcast_owned(self, values=None, dtype=None):
        """Stage 1: each owner sends its parameters (or `values[p]`, of `dtype`) to the group,
        one flat message per dtype; returns {param: tensor} (the parameters by default)."""
        out = {}
        for src in range(self.group.size):
            mine = [p for ps in self._trainable for p in ps if self.owner[p] == src]
            for kind in dict.fromkeys((p.dtype, p.device) for p in mine):
                params = [p for p in mine if (p.dtype, p.device) == kind]
                targets = params if values is None else [
                    values[p] if src == self.group.rank else
                    torch.empty(p.shape, dtype=dtype or p.dtype, device=p.device)
                    for p in params]
                flat = FlatBuffer(targets, copy=src == self.group.rank)
                self.ctx.comm.broadcast(flat.data, src=src, group=self.group,
                                        tag=f"params of rank {src}")
                if src != self.group.rank and values is not None:
                    flat.bind()                  # the received values, one view each
                elif src != self.group.rank:
                    for p, received in zip(params, flat.views()):
                        p.copy_(received)
                out.update(zip(params, targets))
        return out

    def _gather_buckets(self, shards=None):
        """Stage 2: every rank's slice of each bucket (its stepped `shard`, or `shards[i]`),
        to every rank; returns the gathered flat buffers."""
        out = []
        for i, bucket in enumerate(self.buckets):
            full = self.ctx.comm.all_gather(bucket.shard if shards is None else shards[i],
                                            group=self.group,
                                            tag=f"param bucket {bucket.index}")
            if shards is None:
                bucket.data.copy_(full)
            out.append(full)
        return out

    # --- this rank's part of per-parameter tensors, and back -----------------------------------
    def local_part(self, values):
        """This rank's part of one tensor per parameter ({param: tensor}), in the order of the
        inner optimizer's tensors: stage 1 the values of the parameters it owns, stage 2 each
        bucket's slice of the values packed like the parameters (padding: zeros). E.g. the
        unrounded fp32 weights as the masters of `MasterWeights`."""
        if self.stage == 1:
            return [values[p] for g in self.optim.param_groups for p in g["params"]]
        out = []
        for bucket in self.buckets:
            first = values[bucket.tensors[0]]
            flat = FlatBuffer(bucket.tensors, pad_to=self.group.size, dtype=first.dtype,
                              device=first.device, copy=False)
            flat.pack([values[p] for p in bucket.tensors])
            out.append(flat.part(self.group.rank, self.group.size).clone())
        return out

    @torch.no_grad()
    def gather_full(self, local, dtype=None):
        """{param: whole tensor} on every rank from `local`, one tensor per inner-optimizer
        tensor (what `local_part` gives, or e.g. `MasterWeights.masters`), of `dtype` (default:
        local's; pass it where a rank may own nothing). A collective: every rank calls it
        (inside `ctx.off_the_record()` to keep it out of the comm log)."""
        local = list(local)
        if self.stage == 1:
            mine = [p for g in self.optim.param_groups for p in g["params"]]
            full = self._broadcast_owned(dict(zip(mine, local)),
                                         dtype or (local[0].dtype if local else None))
            return {p: t.clone() for p, t in full.items()}
        out = {}
        for bucket, full in zip(self.buckets, self._gather_buckets(local)):
            out.update(zip(bucket.tensors, (v.clone() for v in bucket.views(full))))
        return out

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        self._land()
        for bucket in self.buckets:
            bucket.grad, bucket.arrived = None, set()
        self.optim.zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Scale the gradients so their global L2 norm is at most `max_norm`; returns the norm
        before clipping (stage 2: the shards' squares summed over the group)."""
        self.finish_gradient_synchronization()
        if self.stage == 1:
            grads = [p.grad for ps in self._trainable for p in ps if p.grad is not None]
            norm = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt() \
                if grads else torch.zeros(())
        else:
            grads = [b.shard.grad for b in self.buckets if b.shard.grad is not None]
            square = sum((g.float().pow(2).sum() for g in grads),
                         torch.zeros((), device=self.ctx.device))
            norm = self.ctx.comm.all_reduce(square.reshape(1), group=self.group,
                                            tag="grad norm")[0].sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.device, g.dtype))
        return norm

    # --- memory: what this rank holds -----------------------------------------------------------
    def _watch_memory(self):
        me = weakref.ref(self)
        self.ctx.memory.watch(
            params=lambda: [p for g in me().param_groups for p in g["params"]] if me() else [],
            grads=lambda: me().gradient_tensors() if me() else [],
            optimizer_state=lambda: optimizer_state_tensors(me().optim) if me() else [])

    def gradient_tensors(self):
        """The gradients this rank holds: each parameter's `.grad` (stage 2: None once its
        bucket took it), and under stage 2 its shards' and the full bucket in flight."""
        out = [p.grad for g in self.param_groups for p in g["params"]]
        for bucket in self.buckets:
            out += [bucket.shard.grad, bucket.grad]
        return out

    # --- state dicts: the single-device optimizer's layout, consolidated ---------------------
    def consolidate_state_dict(self, to=0):
        """Gather every rank's optimizer state on member `to` of the group (all must call it):
        afterwards its state_dict() is what `optimizer_class` over the same params would give."""
        local = {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in self.optim.state_dict()["state"].items()}
        everyone = all_gather_objects(local, self.group, tag="optimizer state")
        self._consolidated = None
        if self.group.rank != to:
            return
        state = {}
        if self.stage == 1:
            for rank, rank_state in enumerate(everyone):
                mine = [p for ps in self._trainable for p in ps if self.owner[p] == rank]
                for i, p in enumerate(mine):
                    if i in rank_state:
                        state[self._index[p]] = rank_state[i]
        else:
            for j, bucket in enumerate(self.buckets):
                for key, value in everyone[0].get(j, {}).items():
                    if torch.is_tensor(value) and value.shape == bucket.shard.shape:
                        full = torch.cat([everyone[r][j][key] for r in range(self.group.size)])
                    for p in bucket.tensors:
                        state.setdefault(self._index[p], {})[key] = (
                            bucket.view(p, full).clone() if value.shape == bucket.shard.shape
                            else value.clone()) if torch.is_tensor(value) else value
        self._consolidated = dict(state=state, param_groups=_numbered(self.param_groups))

    def state_dict(self):
        """The consolidated state (call consolidate_state_dict(to=...) first, on every rank)."""
        if getattr(self, "_consolidated", None) is None:
            raise RuntimeError("call consolidate_state_dict(to=...) on every rank first; "
                               "state_dict() answers on the rank it consolidated to")
        return self._consolidated

    def load_state_dict(self, state_dict):
        """Load a consolidated (single-device layout) state dict, on every rank: each keeps its
        own part. Works with another group size than the one that saved it."""
        full = state_dict["state"]
        for outer, saved in zip(self.param_groups, state_dict["param_groups"]):
            outer.update(self._options(saved))
        local = {}
        if self.stage == 1:
            mine = [p for ps in self._trainable for p in ps if self.owner[p] == self.group.rank]
            local = {i: full[self._index[p]] for i, p in enumerate(mine) if self._index[p] in full}
        else:
            for j, bucket in enumerate(self.buckets):
                saved = [p for p in bucket.tensors if self._index[p] in full]
                if saved:
                    local[j] = self._shard_state(bucket, saved, full)
        self.optim.load_state_dict(dict(state=local,
                                        param_groups=_numbered(self.optim.param_groups)))

    def _shard_state(self, bucket, saved, full):
        """This rank's slice of a bucket's state, from the per-parameter state in `full`.

        A key is element-wise when its tensor has the parameter's shape (judged on the largest
        parameter; a 0-dim one cannot tell a 0-dim moment from the step count "step")."""
        judge = max(saved, key=lambda p: p.numel())
        out = {}
        for key, value in full[self._index[judge]].items():
            if torch.is_tensor(value) and value.shape == judge.shape and (
                    judge.dim() > 0 or key != "step"):
                flat = torch.zeros(bucket.padded, dtype=value.dtype)
                for p in saved:
                    bucket.view(p, flat).copy_(full[self._index[p]][key])
                value = bucket.part(self.group.rank, self.group.size, flat)
            out[key] = value.clone() if torch.is_tensor(value) else value
        return out


def _numbered(groups):
    """Param groups as a state dict writes them: options, and parameters as running numbers."""
    out, start = [], 0
    for g in groups:
        out.append(dict({k: v for k, v in g.items() if k != "params"},
                        params=list(range(start, start + len(g["params"])))))
        start += len(g["params"])
    return out
