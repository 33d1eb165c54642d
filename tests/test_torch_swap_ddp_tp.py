"""Swap the import (issue 40): one training script, run on 2 gloo ranks with labkit's
DistributedDataParallel / parallelize_module and with torch's (`torch.nn.parallel`,
`torch.distributed.tensor.parallel`: DTensor on CPU), the same arguments, the same numbers.

DDP: the arithmetic is the same (each rank's gradient halved, summed over 2 ranks: exact in
float32), so losses, parameters and BatchNorm's running stats (broadcast from rank 0 before
each forward in both) are equal bit for bit, with and without no_sync accumulation.
TP (+ SP, loss_parallel) on a two-layer Llama-style model: the sums run in another order, so
both runs are judged by labkit.numerics' rule against one float64 device, and labkit's against
torch's as its float32 reference."""
import contextlib
import copy
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit import numerics
from spawn_helpers import spawn

STEPS = 3


# --------------------------------------------------------------------------- DDP

def ddp_api(which):
    if which == "labkit":
        from labkit.parallel import DistributedDataParallel
    else:
        from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel


def ddp_script(DistributedDataParallel, rank, world, accumulate):
    """The learner's script: the only line that differs between the runs is the import."""
    torch.manual_seed(rank)   # ranks start apart: the wrapper broadcasts rank 0's weights
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 4))
    model = DistributedDataParallel(model, bucket_cap_mb=0.0005)   # a few buckets
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(world * 8, 8, generator=data), torch.randn(world * 8, 4,
                                                                         generator=data)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        if accumulate:   # two micro-batches: the first with no communication
            with model.no_sync():
                F.mse_loss(model(x[:4]), y[:4]).div(2).backward()
            loss = F.mse_loss(model(x[4:]), y[4:]).div(2)
        else:
            loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def run_ddp(rank, world):
    return {(which, accumulate): ddp_script(ddp_api(which), rank, world, accumulate)
            for which in ("labkit", "torch") for accumulate in (False, True)}


def run_all(rank, world):
    """One spawn for every test here (starting 2 ranks costs seconds)."""
    return dict(ddp=run_ddp(rank, world), tp=run_tp(rank, world), refusals=refusals())


@pytest.fixture(scope="module")
def swap_runs():
    return spawn(run_all, 2)


def test_ddp_swap_equals_torch_bit_for_bit(swap_runs):
    results = [r["ddp"] for r in swap_runs]
    for accumulate in (False, True):
        for rank_result in results:
            labkit_losses, labkit_state = rank_result["labkit", accumulate]
            torch_losses, torch_state = rank_result["torch", accumulate]
            assert labkit_losses == torch_losses
            assert labkit_state.keys() == torch_state.keys()
            for name in torch_state:   # parameters and BatchNorm's buffers
                assert torch.equal(labkit_state[name], torch_state[name]), (accumulate, name)
        assert torch.equal(results[0]["labkit", accumulate][1]["3.weight"],
                           results[1]["labkit", accumulate][1]["3.weight"])
    # the runs differ from each other: no_sync changed what was averaged (BatchNorm's batch)
    assert results[0]["torch", True][0] != results[0]["torch", False][0]


def test_ddp_refuses_in_one_line_before_anything_starts():
    from labkit.parallel.data_parallel import DataParallel, DistributedDataParallel
    assert issubclass(DataParallel, DistributedDataParallel)
    model = nn.Linear(2, 2)   # no process group here: the refusal comes first
    with pytest.raises(ValueError, match="not supported by labkit"):
        DistributedDataParallel(model, mixed_precision=object())
    with pytest.raises(ValueError, match="one process drives one device"):
        DistributedDataParallel(model, device_ids=[0])


# --------------------------------------------------------------------------- TP

DIM, HEADS, FFN, VOCAB, SEQ, BATCH = 16, 4, 32, 32, 8, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2)   # -1: the local heads
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tp_api(which):
    if which == "labkit":
        from labkit.parallel import (ColwiseParallel, PrepareModuleInput, Replicate,
                                     RowwiseParallel, SequenceParallel, Shard, loss_parallel,
                                     parallelize_module)
    else:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                       RowwiseParallel, SequenceParallel,
                                                       loss_parallel, parallelize_module)
    return types.SimpleNamespace(**{k: v for k, v in locals().items() if k != "which"})


def tp_script(api, model, mesh, sequence_parallel, batches):
    """The learner's script (torchtitan's plan): the same for both runs."""
    ColwiseParallel, RowwiseParallel, Replicate, Shard = (
        api.ColwiseParallel, api.RowwiseParallel, api.Replicate, api.Shard)
    if sequence_parallel:
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1)),
                "norm": api.SequenceParallel(),
                "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)}
        prepare = api.PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),))
        plan.update({"layers.*.attention_norm": api.SequenceParallel(),
                     "layers.*.attention": prepare,
                     "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                     "layers.*.ffn_norm": api.SequenceParallel(),
                     "layers.*.feed_forward": prepare,
                     "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    else:
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Replicate()),
                "layers.*.attention.wo": RowwiseParallel(),
                "layers.*.feed_forward.w2": RowwiseParallel()}
    plan.update({f"layers.*.{name}": ColwiseParallel() for name in
                 ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                  "feed_forward.w3")})
    model = api.parallelize_module(model, mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for ids, targets in batches:
        logits = model(ids)
        with api.loss_parallel() if sequence_parallel else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def single_device(model, batches):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for ids, targets in batches:
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def run_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from labkit.parallel.tensor_parallel import gather_params
    from labkit.runtime.mesh import Mesh
    torch.manual_seed(0)
    base = TinyLlama()
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randint(VOCAB, (BATCH, SEQ), generator=data),
                torch.randint(VOCAB, (BATCH, SEQ), generator=data)) for _ in range(STEPS)]
    out = {"initial": {k: v.detach().clone() for k, v in base.named_parameters()},
           "single": single_device(copy.deepcopy(base), batches),
           "exact": single_device(numerics.exact_copy(base), [b for b in batches])}
    torch_mesh = init_device_mesh("cpu", (world,))
    for sequence_parallel in (False, True):
        # labkit gets its own mesh dimension once, torch's DeviceMesh once: both are accepted
        mesh = torch_mesh if sequence_parallel else Mesh(tp=world)["tp"]
        model, losses = tp_script(tp_api("labkit"), copy.deepcopy(base), mesh,
                                  sequence_parallel, batches)
        out["labkit", sequence_parallel] = losses, gather_params(model)
        model, losses = tp_script(tp_api("torch"), copy.deepcopy(base), torch_mesh,
                                  sequence_parallel, batches)
        out["torch", sequence_parallel] = losses, {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.named_parameters()}
    return out


class Echo(nn.Module):
    def forward(self, x, *, y):
        return y


def refusals():
    """What each rank saw: the old names' warnings, the refusals (and that nothing was split)."""
    import warnings
    from labkit.parallel import (ColwiseParallel, DataParallel, PrepareModuleInput,
                                 Replicate, Shard, loss_parallel, parallelize,
                                 parallelize_module)
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DataParallel(nn.Linear(2, 2))
        parallelize(nn.Sequential(nn.Linear(4, 4)), {"0": "colwise"})
    seen["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    from torch.distributed.device_mesh import init_device_mesh
    from labkit.parallel import DistributedDataParallel
    from labkit.runtime.mesh import Mesh
    seen["ddp groups"] = [DistributedDataParallel(nn.Linear(2, 2), device_mesh=mesh).group.size
                          for mesh in (init_device_mesh("cpu", (2,)), Mesh(dp=2)["dp"])]
    model = nn.Sequential(nn.Linear(4, 4), nn.Embedding(4, 4))
    try:
        parallelize_module(model, None, {"0": ColwiseParallel(), "1": ColwiseParallel()})
    except ValueError as error:
        seen["embedding"] = (str(error), type(model[0]).__name__)
    seen["kwarg"] = tuple(parallelize_module(Echo(), None, PrepareModuleInput(
        input_kwarg_layouts={"y": Shard(1)}, desired_input_kwarg_layouts={"y": Replicate()}))(
            torch.zeros(1), y=torch.ones(2, 3, 4)).shape)   # the sequence gathered: 3 -> 6
    try:
        PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1))
    except ValueError as error:
        seen["scatter"] = str(error)
    torch.manual_seed(0)   # the same head and input on both ranks
    head, x, targets = nn.Linear(4, 8), torch.randn(3, 4), torch.tensor([0, 5, 7])
    whole = copy.deepcopy(head)
    seen["single"] = F.cross_entropy(whole(x), targets).item()
    seen["exact"] = F.cross_entropy(whole.double()(x.double()), targets).item()
    logits = parallelize_module(head, None, ColwiseParallel(use_local_output=False))(x)
    try:
        F.cross_entropy(logits, targets)
    except ValueError as error:
        seen["outside"] = str(error)
    with loss_parallel():   # the vocabulary-parallel loss, logits never gathered
        seen["inside"] = F.cross_entropy(logits.view(3, -1), targets).item()
    return seen


def test_old_names_warn_and_styles_refuse_in_one_line(swap_runs):
    for seen in (r["refusals"] for r in swap_runs):
        categories = {category for category, _ in seen["warnings"]}
        assert categories == {"DeprecationWarning"}
        text = " ".join(message for _, message in seen["warnings"])
        assert "DistributedDataParallel" in text and "parallelize_module" in text
        message, first_layer = seen["embedding"]
        assert "ColwiseParallel on 1 (Embedding)" in message and "\n" not in message
        assert first_layer == "Linear"   # refused before the first entry was split
        assert seen["kwarg"] == (2, 6, 4)
        assert "from Shard(1) to Replicate() only" in seen["scatter"]
        assert seen["ddp groups"] == [2, 2]   # torch's DeviceMesh, a labkit mesh dimension
        assert "inside loss_parallel()" in seen["outside"]
        assert numerics.compare_loss([seen["inside"]], [seen["single"]], [seen["exact"]])


@pytest.mark.numerics
def test_parallelize_module_swap_equals_torch(swap_runs):
    for out in (r["tp"] for r in swap_runs):
        single_losses, single_params = out["single"]
        exact_losses, exact_params = out["exact"]
        for sequence_parallel in (False, True):
            for which in ("labkit", "torch"):
                losses, params = out[which, sequence_parallel]
                assert params.keys() == single_params.keys()
                assert numerics.compare_loss(losses, single_losses, exact_losses)
                assert numerics.compare(params, single_params, exact_params), (
                    which, sequence_parallel, numerics.compare(params, single_params,
                                                               exact_params))
            labkit_losses, labkit_params = out["labkit", sequence_parallel]
            torch_losses, torch_params = out["torch", sequence_parallel]
            agreement = numerics.compare(labkit_params, torch_params, exact_params)
            print(f"sequence_parallel={sequence_parallel}: labkit vs torch's parallel run: "
                  f"{agreement}")
            assert agreement
            assert numerics.compare_loss(labkit_losses, torch_losses, exact_losses)
        # the steps moved the weights well beyond rounding: a run that did nothing would fail
        assert not numerics.compare(out["initial"], single_params, exact_params)
