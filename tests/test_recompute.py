"""Selective recompute as a block (parallel/recompute.py): each attention core checkpointed.
The numbers do not move (the same ops run again), and what autograd keeps drops by exactly the
core's own saved tensors: the fp32 softmax, a s^2 b per layer, and its causal mask, s^2 bools
(models.causal_attention; theory.memory.tiny_gpt_activation_bytes counts the first, its
as^2b term)."""
import pytest
import torch
import torch.nn as nn

from labkit import models
from labkit.parallel.recompute import checkpoint_attention_cores
from labkit.runtime.memory import MemoryTracker

CFG = dict(layers=3, seq=16, hidden=32, heads=4, vocab=64, ffn=64)


def train_step(selective, batch=2):
    model = models.build("gpt", seed=0, **CFG)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, CFG["vocab"], (batch, CFG["seq"]), generator=g) for _ in "xy")
    handle = checkpoint_attention_cores([b.attn for b in model.blocks], "TinyGPT") \
        if selective else None
    tracker = MemoryTracker()
    with tracker.track_activations():
        loss = model(x, y)
        calls = handle.calls if handle else 0
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, tracker.max_saved_bytes, calls


def test_same_numbers_fewer_saved_bytes():
    loss, grads, none_bytes, _ = train_step(False)
    loss_s, grads_s, selective_bytes, calls = train_step(True)
    # the core runs again on the same inputs: bit for bit the same loss and gradients
    assert torch.equal(loss, loss_s) and all(torch.equal(grads[n], grads_s[n]) for n in grads)
    assert calls == CFG["layers"]
    b, s, a = 2, CFG["seq"], CFG["heads"]
    per_layer = 4 * a * s * s * b + s * s          # softmax (fp32) + causal mask (bool)
    assert none_bytes - selective_bytes == CFG["layers"] * per_layer


def test_no_attention_is_refused_naming_the_model():
    with pytest.raises(ValueError) as err:
        checkpoint_attention_cores([], "MLP")
    assert "MLP" in str(err.value) and "\n" not in str(err.value)


class HandWrittenAttention(nn.Module):
    """softmax(QK^T)V by hand: no core call for the block to checkpoint."""

    def __init__(self, hidden=8):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return (q @ k.transpose(-2, -1)).softmax(-1) @ v


def test_hand_written_core_is_refused_when_it_runs():
    layer = HandWrittenAttention()
    checkpoint_attention_cores([layer], "MyModel")
    with torch.no_grad():          # no gradients: nothing to keep, nothing refused
        layer(torch.randn(1, 4, 8))
    with pytest.raises(ValueError) as err:
        layer(torch.randn(1, 4, 8))
    assert "MyModel's HandWrittenAttention" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("options, words", [
    (dict(recompute="some"), "recompute must be"),
    (dict(recompute="selective", recompute_layers=1), "recompute_layers must be"),
    (dict(recompute="full", recompute_layers=1, zero=3), "zero_stage=3"),
    (dict(recompute="full", recompute_layers=1, schedule="interleaved", virtual=2),
     "virtual > 1"),
])
def test_mesh_refuses_before_any_rank(options, words):
    from labkit.runs import hybrid
    with pytest.raises(ValueError) as err:
        hybrid.report(dp=2, tp=1, pp=2, timeout_s=1, **options)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_k_of_l_blocks_on_the_mesh():
    """tp=2, 2 blocks: recomputing k = 0, 1, 2 of them keeps fewer activations each time,
    runs 2 more TP all-reduces (attention and MLP outputs) per rebuilt block and micro-batch,
    and equals one device."""
    from labkit.runs import hybrid, reference
    from labkit.theory.time import wire_bytes_per_rank
    cfg = reference.RunConfig(steps=1, global_batch=4, model_kwargs=dict(
        layers=2, hidden=32, heads=4, ffn=64, vocab=64, seq=16))
    acts, tp = [], []
    for k in (0, 1, 2):
        rep = hybrid.report(cfg=cfg, dp=1, tp=2, pp=1, microbatches=2, recompute="full",
                            recompute_layers=k, timeout_s=120)
        assert rep["agreement"]["params"]["ok"] and rep["agreement"]["loss"]["ok"], k
        acts.append(max(m["activations"] for m in rep["memory"].values()))
        tp.append(sum(r["wire_bytes"] for r in rep["comm_by_dim"] if r["dim"] == "tp") / 2)
    assert acts[0] > acts[1] > acts[2], acts
    one = wire_bytes_per_rank("all_reduce", 4 * 2 * 16 * 32, 2)   # fp32 (b=2, s=16, h=32)
    assert [b - tp[0] for b in tp] == [0, 2 * 2 * one, 2 * 2 * 2 * one], tp


def cp_runs(ctx):
    """On 2 ranks: TinyGPT with each attention in ContextParallel (ring, all-gather), with and
    without selective recompute on the wrappers: loss, gradients, saved and wire bytes."""
    from labkit.parallel.context_parallelism import ContextParallel, shard_sequence
    out = {}
    for method in ("ring", "all_gather"):
        for selective in (False, True):
            model = models.build("gpt", seed=0, **CFG)
            for block in model.blocks:
                block.attn = ContextParallel(block.attn, None, "zigzag", method)
            if selective:
                checkpoint_attention_cores([b.attn for b in model.blocks], "TinyGPT",
                                           require_core=False)
            g = torch.Generator().manual_seed(1)
            x, y = (shard_sequence(torch.randint(0, CFG["vocab"], (2, CFG["seq"]), generator=g),
                                   None, "zigzag", dim=1) for _ in "xy")
            ctx.comm.reset()
            tracker = MemoryTracker()
            with tracker.track_activations():
                loss = model(x, y)
                loss.backward()
            wire = sum(r["wire_bytes_per_rank"] for r in ctx.comm.summary(by=("op", "tag")))
            out[method, selective] = (loss.detach(), [p.grad.clone() for p in model.parameters()],
                                      tracker.max_saved_bytes, wire)
    return out


def test_on_the_cp_wrapper_the_ring_is_left_alone_and_all_gather_checkpointed():
    """Selective recompute on ContextParallel wrappers: the numbers do not move and no
    collective repeats (the same wire bytes); the ring keeps no scores, so its saved bytes do
    not move either, while the all-gather core's SDPA over the gathered keys is checkpointed."""
    import labkit
    for rank in labkit.launch(cp_runs, 2, timeout_s=120):
        for method in ("ring", "all_gather"):
            (loss, grads, saved, wire), (loss_s, grads_s, saved_s, wire_s) = (
                rank[method, False], rank[method, True])
            assert torch.equal(loss, loss_s) and all(map(torch.equal, grads, grads_s)), method
            assert wire == wire_s > 0, method
        assert rank["ring", True][2] == rank["ring", False][2]
        assert rank["all_gather", True][2] < rank["all_gather", False][2]
