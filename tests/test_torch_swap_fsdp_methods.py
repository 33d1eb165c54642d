"""fully_shard's FSDPModule methods swapped for torch's: one learner script, run on 2 gloo ranks
with `from labkit.parallel import fully_shard` and with `from torch.distributed.fsdp import
fully_shard` (same DeviceMesh, same calls), 3 layers then the root, 3 steps of Adam, in fp32
and with bf16 compute (fp32 reduce):
  accumulate   2 micro-batches a step: `set_requires_gradient_sync(False)` on the first,
               True on the second (one reduce-scatter a step, of the sum)
  keep         the same, and `set_reshard_after_backward(False)` on the first micro-batch
  prefetch     torchtitan's explicit prefetch: each layer prefetches the next in forward and
               the previous in backward (`set_modules_to_forward/backward_prefetch`)
  unshard      `unshard()` / `reshard()` on a layer and `unshard(async_op=True)` + `wait()` on
               another before training: the full parameters shown, then the rows again
Each rank's losses and rows of every parameter equal torch's bit for bit. labkit's comm log
shows what each method saves, and that a prefetched all-gather is issued before the current
layer computes (in forward and in backward). One spawn runs everything."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from spawn_helpers import spawn

STEPS, BATCH, WIDTH, LAYERS = 3, 8, 7, 3
POLICIES = {"fp32": {}, "bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
FEATURES = ("plain", "accumulate", "keep", "prefetch", "unshard")
NOTES = []   # what a layer saw of labkit's comm log when it computed (the ordering test)


def _note(when):
    if NOTES and NOTES[0] == "on":
        import labkit
        issued = [r for r in labkit.context().comm.records
                  if (r.op, r.tag) == ("all_gather", "params Block")]
        NOTES.append((when, len(issued)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        _note("forward")
        mid = self.mix(self.norm(h))
        if mid.requires_grad:   # runs when this layer's backward computes
            mid.register_hook(lambda grad: _note("backward"))
        return h + torch.tanh(mid)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(6, WIDTH), nn.Linear(WIDTH, 3)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def batch(step):
    g = torch.Generator().manual_seed(20 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def rows_of(module):
    """Each parameter as the module shows it now (torch's DTensor shards: their rows)."""
    return {n: getattr(p, "to_local", lambda p=p: p)().detach().clone()
            for n, p in module.named_parameters()}


def script(rank, world_size, which, policy, feature):
    """The learner's script: only the import differs."""
    if which == "torch":
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
    else:
        from labkit.parallel import fully_shard, MixedPrecisionPolicy
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = Stack()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(**policy))
    fully_shard(model, mesh=mesh,
                mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))
    out = {}
    if feature == "prefetch":   # torchtitan's: each layer the next (forward), previous (back)
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
    if feature == "unshard":
        first, second = model.layers[0], model.layers[1]
        first.unshard()
        out["unsharded"] = rows_of(first)
        first.reshard()
        out["resharded"] = rows_of(first)
        handle = second.unshard(async_op=True)
        handle.wait()
        out["unsharded async"] = rows_of(second)
        second.reshard()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, share = [], BATCH // world_size
    micro = 2 if feature in ("accumulate", "keep") else 1
    for step in range(STEPS):
        x, y = (t[rank * share:(rank + 1) * share] for t in batch(step))
        for m, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            last = m == micro - 1
            if micro > 1:
                model.set_requires_gradient_sync(last)
            if feature == "keep":
                model.set_reshard_after_backward(last)
            loss = F.mse_loss(model(xm), ym) / micro
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    out.update(losses=torch.stack(losses), rows=rows_of(model))
    return out


def _ordering(rank, world_size, prefetch):
    """labkit's comm log as each layer computes, in the first step's forward and backward."""
    import labkit
    labkit.context().comm.reset()
    NOTES[:] = ["on"]
    script(rank, world_size, "labkit", {}, "prefetch" if prefetch else "plain")
    notes, NOTES[:] = NOTES[1:1 + 2 * LAYERS], []
    return notes


def _everything(rank, world_size):
    import labkit
    out = {}
    for policy in POLICIES:
        for feature in FEATURES:
            for which in ("labkit", "torch"):
                labkit.context().comm.reset()
                out[which, policy, feature] = script(rank, world_size, which,
                                                     POLICIES[policy], feature)
                out[which, policy, feature]["comm"] = {
                    (row["op"], row["tag"]): row["calls"]
                    for row in labkit.context().comm.summary(by=("op", "tag"))}
    out["order", "prefetch"] = _ordering(rank, world_size, True)
    out["order", "plain"] = _ordering(rank, world_size, False)
    out["refusal"] = _refusal()
    return out


def _refusal():
    from labkit.parallel import fully_shard
    try:
        fully_shard(nn.Linear(2, 2)).set_modules_to_forward_prefetch([nn.Linear(2, 2)])
    except ValueError as e:
        return str(e)


_RESULTS = {}


def results():
    if not _RESULTS:
        _RESULTS["ranks"] = spawn(_everything, 2)
    return _RESULTS["ranks"]


def test_each_method_equals_torch_bit_for_bit():
    for rank, out in enumerate(results()):
        for policy in POLICIES:
            for feature in FEATURES:
                mine, theirs = out["labkit", policy, feature], out["torch", policy, feature]
                assert mine.keys() == theirs.keys()
                assert torch.equal(mine["losses"], theirs["losses"]), (rank, policy, feature)
                for what in ("rows", "unsharded", "resharded", "unsharded async"):
                    for name, rows in mine.get(what, {}).items():
                        assert torch.equal(rows, theirs[what][name]), (rank, policy, feature,
                                                                       what, name)


def test_the_methods_change_the_training_only_where_they_should():
    """Prefetch and unshard/reshard leave the step as it was; accumulation over two halves
    trains alike within rounding (the gradient summed in a different order)."""
    out = results()[0]
    for policy in POLICIES:
        plain = out["labkit", policy, "plain"]
        for feature in ("prefetch", "unshard"):
            assert torch.equal(out["labkit", policy, feature]["losses"], plain["losses"])
            for name, rows in plain["rows"].items():
                assert torch.equal(out["labkit", policy, feature]["rows"][name], rows)
        keep, accumulate = out["labkit", policy, "keep"], out["labkit", policy, "accumulate"]
        assert torch.equal(keep["losses"], accumulate["losses"])
        summed = accumulate["losses"].view(STEPS, 2).sum(1)
        assert torch.allclose(summed, plain["losses"], rtol=2e-2 if policy == "bf16" else 1e-5)


def test_unshard_shows_the_full_parameters_and_reshard_the_rows():
    torch.manual_seed(0)
    full = dict(Stack().layers[0].named_parameters())
    for rank, out in enumerate(results()):
        mine = out["labkit", "fp32", "unshard"]
        for name, p in full.items():
            assert torch.equal(mine["unsharded"][name], p.detach())
            assert torch.equal(mine["resharded"][name], p.detach().chunk(2)[rank])


def test_sync_off_reduce_scatters_once_a_step():
    """Per step, 2 micro-batches: every layer gathered before each forward and each backward
    (4), the root once a micro-batch; one reduce-scatter per group. Kept after the first
    backward (set_reshard_after_backward(False)): the second forward gathers nothing."""
    for policy in POLICIES:
        out = results()[0]
        assert out["labkit", policy, "accumulate"]["comm"] == {
            ("all_gather", "params Block"): LAYERS * 4 * STEPS,
            ("all_gather", "params Stack"): 2 * STEPS,
            ("reduce_scatter", "grads Block"): LAYERS * STEPS,
            ("reduce_scatter", "grads Stack"): STEPS}
        assert out["labkit", policy, "keep"]["comm"] == {
            ("all_gather", "params Block"): LAYERS * 3 * STEPS,
            ("all_gather", "params Stack"): STEPS,
            ("reduce_scatter", "grads Block"): LAYERS * STEPS,
            ("reduce_scatter", "grads Stack"): STEPS}
        assert out["torch", policy, "accumulate"]["comm"] == {}   # torch's goes past the log


def test_prefetch_issues_the_next_all_gather_before_the_current_layer_computes():
    """The layers' all-gathers issued when each layer computes, in the first step. Without
    prefetch: only its own (1, 2, 3 in forward; 4, 5, 6 in backward, last layer first). With
    it: the next layer's too (2, 3, 3; 5, 6, 6): the same gathers, each one a layer earlier,
    as many as without prefetch."""
    for out in results():
        assert out["order", "plain"] == [("forward", 1), ("forward", 2), ("forward", 3),
                                         ("backward", 4), ("backward", 5), ("backward", 6)]
        assert out["order", "prefetch"] == [("forward", 2), ("forward", 3), ("forward", 3),
                                            ("backward", 5), ("backward", 6), ("backward", 6)]
        for policy in POLICIES:
            assert out["labkit", policy, "prefetch"]["comm"] == \
                out["labkit", policy, "plain"]["comm"]


def test_prefetch_refuses_a_module_fully_shard_did_not_take():
    assert results()[0]["refusal"].startswith("Expects FSDPModule but got")
