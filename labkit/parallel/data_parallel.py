"""DistributedDataParallel: a replica of any nn.Module per rank, gradients averaged in buckets.

The idea. N replicas start from the same weights (the group's first member broadcasts its
parameters and buffers when the wrapper is built). Each rank runs forward and backward on its
own 1/N of the global batch; because the loss is a mean over examples, the average of the N
shard gradients is the full-batch gradient, so every replica takes the step one device would
take on the whole batch.

Memory per rank: the whole model, Ψ parameters with their gradients and optimizer state
(fp32 Adam: 4Ψ + 4Ψ + 8Ψ bytes), plus one flat copy of the gradients as buckets (4Ψ), unless
`gradient_as_bucket_view=True` makes `.grad` a view of the buckets (no copy). Activations: those
of global_batch / N examples.

Communication per rank and step: an all-reduce of the S = 4Ψ gradient bytes; a ring sends
2(N-1)/N x S bytes per rank, under 2S whatever N (Patarasuk & Yuan 2009). That traffic does not
shrink as N grows while the compute does, so it is hidden under backward: parameters are grouped
into buckets of ~`bucket_mb` MiB in reverse order (backward produces the last layer's gradients
first); a post-accumulate-grad hook copies each gradient into its bucket, and a full bucket's
async all-reduce starts at once while backward computes the earlier layers. What PyTorch's
DistributedDataParallel does (Li et al. 2020, "PyTorch Distributed", arXiv 2006.15704).

    model = DistributedDataParallel(model, process_group=None, bucket_cap_mb=25)
    loss = loss_fn(model(x_shard), y_shard)
    loss.backward()             # buckets all-reduce during backward; averaged .grad at its end
    optimizer.step()

torch's signature and semantics (`no_sync()` included), so a script swaps the import for
`torch.nn.parallel`'s and gets the same numbers (tests/test_torch_swap_ddp_tp.py); what stays
different on purpose: docs/torch-differences.md. `DataParallel` is the earlier, deprecated name.
Every rank issues the bucket all-reduces in the same order (bucket 0, 1, 2, ...), whatever order
its hooks fire in: a collective matches the others' by its place in that sequence.
`ring_all_reduce(ctx, tensor)` is that all-reduce's ring, from send and recv only.
"""
import itertools
import warnings
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..runtime.comm import GroupLike
from ..runtime import torch_compat
from ..runtime.context import context
from .flat import FlatBuffer, bucket_params

_instances = itertools.count()   # tells the memory tracker's buffers of two wrappers apart


class DistributedDataParallel(nn.Module):
    """Data parallelism on any nn.Module inside any process group, with torch's signature.

    process_group: None (the world), a labkit Group or a torch ProcessGroup; device_mesh: a
        1-D mesh (torch's DeviceMesh or a labkit mesh dimension) instead of it.
    bucket_cap_mb: bucket size in MiB (2**20 bytes); 0 gives one bucket per parameter, each
        launched as soon as its gradient is ready (torch: None means 25).
    broadcast_buffers / forward_sync_buffers: as in torch 2.13, buffers are broadcast from the
        group's first member before each forward that follows a synchronising one (BatchNorm's
        running stats); `broadcast_buffers=False` skips the initial buffer broadcast too,
        `forward_sync_buffers=False` only the per-forward one.
    gradient_as_bucket_view: each `.grad` becomes a view into its bucket (saves the copy and
        4Ψ bytes); then the buckets are counted as gradients, not as buffers.
    find_unused_parameters, static_graph, check_reduction, dim: accepted; labkit needs no
        unused-parameter search (a bucket whose gradient never came is reduced with zeros at the
        end of backward), and one device per process has nothing to scatter along `dim`.
    overlap (labkit only, keyword): False launches every bucket after backward, to measure
        what overlapping buys. Frozen parameters get no hook; a tied parameter is reduced once.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: GroupLike = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None,
                 forward_sync_buffers: bool | None = None, *, overlap: bool = True) -> None:
        super().__init__()
        _refuse_unsupported(module, device_ids, output_device, process_group, device_mesh,
                            delay_all_reduce_named_params=delay_all_reduce_named_params,
                            param_to_hook_all_reduce=param_to_hook_all_reduce,
                            mixed_precision=mixed_precision)
        bucket_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb
        if bucket_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_mb}")
        self.module = module
        self._ctx = context()
        if device_mesh is not None:   # torch's DeviceMesh, or a labkit mesh dimension
            get_group = getattr(device_mesh, "get_group", None)
            process_group = get_group() if get_group else device_mesh
        self.group = self._ctx.group(process_group)
        self.process_group = self.group
        self.bucket_mb, self.overlap = bucket_mb, overlap
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        if forward_sync_buffers is None:   # torch 2.13's reading of the two flags
            forward_sync_buffers = True if broadcast_buffers is None else broadcast_buffers
            init_sync_buffers = forward_sync_buffers
        else:
            init_sync_buffers = True
        self.forward_sync_buffers = self.broadcast_buffers = forward_sync_buffers
        self.require_backward_grad_sync = True   # False inside no_sync()
        self.require_forward_param_sync = True   # set by each forward, as in DDP
        self._sync_this_backward = True          # what the last forward saw (as in DDP)
        self._name = f"DataParallel {next(_instances)}"
        if init_sync:
            self._broadcast_from_first_member(buffers=init_sync_buffers)
        self._build_buckets()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient)
                       for p in self._params]
        self._reset_round()

    # --- construction ------------------------------------------------------------------------
    @torch.no_grad()
    def _broadcast_from_first_member(self, parameters=True, buffers=True):
        """Every replica starts from member 0's parameters and buffers (frozen ones included)."""
        tensors = (list(self.module.parameters()) if parameters else []) + (
            list(self.module.buffers()) if buffers else [])
        for t in tensors:   # parameters() and buffers() already skip a tensor seen twice
            self._ctx.comm.broadcast(t.detach(), src=0, group=self.group,
                                     tag="DataParallel broadcast")

    def _build_buckets(self):
        """Trainable parameters in reverse order, cut into buckets of about bucket_mb MiB."""
        self._params = [p for p in self.module.parameters() if p.requires_grad][::-1]
        groups = bucket_params(self._params, self.bucket_mb * 2 ** 20, may_exceed=True)
        self._buckets = [FlatBuffer(members, index=i, copy=False)
                         for i, members in enumerate(groups)]
        self._bucket_of = {p: b for b in self._buckets for p in b.tensors}
        if not self.gradient_as_bucket_view:   # a separate copy: count it as a buffer
            for b in self._buckets:
                self._ctx.memory.add_buffer(self._buffer_name(b.index), b.data)

    def _buffer_name(self, i):
        first = self._name == "DataParallel 0"
        return f"grad bucket {i}" if first else f"grad bucket {i} ({self._name})"

    @property
    def bucket_sizes(self):
        """Bytes per bucket, in launch order."""
        return [b.nbytes for b in self._buckets]

    # --- forward and no_sync -------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.forward_sync_buffers and self.require_forward_param_sync:
            self._broadcast_from_first_member(parameters=False)   # no-op without buffers
        # As in DDP, the forward decides whether the backward that follows synchronises.
        self._sync_this_backward = self.require_backward_grad_sync
        self.require_forward_param_sync = (torch.is_grad_enabled()
                                           and self.require_backward_grad_sync)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Forward and backward inside accumulate gradients locally, with no communication."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    # --- backward: fill buckets, launch full ones in order ---------------------------------------
    def _reset_round(self):
        for bucket in getattr(self, "_buckets", ()):
            bucket.arrived, bucket.handle = set(), None   # gradients arrived in this backward
        self._next = 0          # the next bucket to launch (every rank launches in this order)
        self._collecting = False
        self._finished = False  # set by the end-of-backward callback

    def _on_gradient(self, p):
        if not self._sync_this_backward:
            return              # no_sync: the gradient stays in p.grad and accumulates there
        if not self._collecting:
            if self._finished:  # a new backward after one that finished on its own
                self._reset_round()
            self._collecting = True
            # Like DDP: wait for the buckets when the autograd engine finishes this backward.
            torch_compat.queue_callback(self._end_of_backward)
        bucket = self._bucket_of[p]
        view = bucket.view(p)
        if self.gradient_as_bucket_view:
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view   # the bucket is the gradient from now on
        else:
            view.copy_(p.grad)
        bucket.arrived.add(p)
        if self.overlap:
            self._launch(only_full=True)

    def _launch(self, only_full):
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if only_full and not bucket.complete:
                return
            for p in bucket.tensors:   # no gradient on this rank: it contributes zeros
                if p not in bucket.arrived:
                    bucket.view(p).zero_()
            bucket.handle = self._ctx.comm.all_reduce(bucket.data, op="avg", group=self.group,
                                                      async_op=True, tag=f"bucket {bucket.index}")
            self._next += 1

    def _end_of_backward(self):
        self.finish_gradient_synchronization()
        self._finished = True

    def finish_gradient_synchronization(self):
        """Launch the buckets not launched yet, wait for all, leave averaged `.grad`s.

        Runs by itself at the end of each synchronising backward (calling it again is free).
        Call it yourself on a rank whose backward reached none of the parameters, so that it
        still joins the all-reduces the other ranks issue. Inside no_sync() it does nothing.
        """
        if self._finished:
            self._finished = False   # the explicit call after the automatic one: nothing left
            return
        if not self._sync_this_backward:
            return
        self._launch(only_full=False)
        for bucket in self._buckets:
            bucket.handle.wait()     # the average (sum / group size) is in bucket.data now
            for p in bucket.tensors:
                view = bucket.view(p)
                if self.gradient_as_bucket_view or p.grad is None:
                    p.grad = view if self.gradient_as_bucket_view else view.clone()
                else:
                    p.grad.copy_(view)
        self._reset_round()

    def extra_repr(self):
        return (f"group={list(self.group.ranks)}, bucket_mb={self.bucket_mb}, "
                f"overlap={self.overlap}, buckets={len(self._buckets)}")



def ring_all_reduce(ctx, tensor, group: GroupLike = None, op: str = "sum") -> torch.Tensor:
    """Sum (or average, op="avg") `tensor` over the group in place, with only send and recv:
    the algorithm under the all-reduce above, written out (lesson 01's exercise answer).

    Cut the tensor into N chunks. Reduce-scatter: in step s (of N-1) member r sends chunk
    (r - s) mod N to its right neighbour and adds what its left neighbour sends into chunk
    (r - s - 1) mod N; afterwards member r owns the full sum of chunk (r + 1) mod N. All-gather:
    N-1 more steps pass the finished chunks around the ring. Each rank sent 2(N-1) chunks of
    S/N bytes: 2(N-1)/N x S. Sends are async (post the send, then receive, then wait): if every
    rank first waited in recv, nobody would ever send. Neighbours are ranks of the group.
    """
    g = ctx.group(group)
    n, r = g.size, g.rank
    if n == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    chunks = list(torch.tensor_split(flat, n))
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):                        # reduce-scatter
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        tag = f"ring reduce-scatter step {s}"
        handle = ctx.comm.send(chunks[send_i], right, group=g, async_op=True, tag=tag)
        ctx.comm.recv(incoming, left, group=g, tag=tag)
        handle.wait()
        chunks[recv_i].add_(incoming)
    for s in range(n - 1):                        # all-gather
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        tag = f"ring all-gather step {s}"
        handle = ctx.comm.send(chunks[send_i], right, group=g, async_op=True, tag=tag)
        ctx.comm.recv(chunks[recv_i], left, group=g, tag=tag)
        handle.wait()
    if op == "avg":
        flat.div_(n)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def _refuse_unsupported(module, device_ids, output_device, process_group, device_mesh,
                        **unsupported):
    """One line for what this DDP leaves out, before anything is built."""
    for name, value in unsupported.items():
        if value is not None:
            raise ValueError(f"DistributedDataParallel({name}=...) is not supported by labkit "
                             "(docs/torch-differences.md); leave it None")
    if process_group is not None and device_mesh is not None:
        raise ValueError("DistributedDataParallel takes process_group or device_mesh, not both")
    device = next(module.parameters(), torch.empty(0)).device
    for name, ids in (("device_ids", device_ids), ("output_device", output_device)):
        if ids is None:
            continue
        ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
        if device.type == "cpu" or len(ids) != 1 or torch.device(ids[0]).index != device.index:
            raise ValueError(f"DistributedDataParallel({name}={ids}): one process drives one "
                             f"device, the module's ({device}); pass None or that one device")


class DataParallel(DistributedDataParallel):
    """labkit's earlier name and signature for DistributedDataParallel (deprecated):
    `DataParallel(module, group, bucket_mb, overlap, gradient_as_bucket_view)` is
    `DistributedDataParallel(module, process_group=group, bucket_cap_mb=bucket_mb,
    gradient_as_bucket_view=..., forward_sync_buffers=False, overlap=overlap)`: buffers are
    broadcast once, when it is built. (torch's own `nn.DataParallel` is the older
    single-process, multi-thread wrapper, which this is not.)"""

    def __init__(self, module: nn.Module, group: GroupLike = None, bucket_mb: float = 25.0,
                 overlap: bool = True, gradient_as_bucket_view: bool = False) -> None:
        warnings.warn("labkit.parallel.DataParallel(module, group, bucket_mb) is deprecated: "
                      "use DistributedDataParallel(module, process_group=group, "
                      "bucket_cap_mb=bucket_mb), torch's name and signature",
                      DeprecationWarning, stacklevel=2)
        if bucket_mb < 0:
            raise ValueError(f"bucket_mb must be >= 0, got {bucket_mb}")
        super().__init__(module, process_group=group, bucket_cap_mb=bucket_mb,
                         gradient_as_bucket_view=gradient_as_bucket_view,
                         forward_sync_buffers=False, overlap=overlap)
