"""Context parallelism on a Hugging Face Llama built from a tiny config (random weights, never
downloaded), on 2 ranks, fp32.

`ContextParallel(model)` + `context_parallel_batch` (global position ids, labels shifted before
sharding, the batch's mean loss): the averaged gradients and the loss equal transformers' own
`model(input_ids, labels=labels).loss` on one device, within rounding (labkit.numerics: against
the float64 run, a few times float32's own error), for the contiguous and the zigzag layout
(ring; all-gather and Ulysses once each; the zigzag ring in bfloat16 too, judged by bfloat16's
own error), with some labels ignored (-100) so that the shards count different tokens.
Sharding the ids and labels and calling the model as usual is measured too, and is far off.
The refusals, each on every rank: eager attention (no scaled_dot_product_attention call to
route) and a hand-written attention name their module; a sliding window shorter than the
sequence (the cores mask causally only); transformers' packed-sequence mask
path (zigzag positions with use_cache=False: a 4-D mask on one rank only) is refused on both
ranks before either enters the ring, so none waits forever. Falcon builds its own causal mask
on every call: refused naming that cause, and built with `causal_sdpa()` (the advice) its
gradients and loss equal one device. A convolution along the sequence (Mamba-style mixers) is
refused.
"""
import pytest
import torch
import torch.nn as nn

import labkit
from labkit import numerics
from labkit.parallel.context_batch import causal_sdpa
from labkit.parallel.context_parallelism import ContextParallel, context_parallel_batch
from labkit.parallel.flat import average_gradients

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 128, 16, 2
CASES = [("contiguous", "ring"), ("zigzag", "ring"), ("zigzag", "all_gather"),
         ("contiguous", "ulysses")]     # Ulysses: 2 KV heads over 2 ranks
RUNS = [c + (torch.float32,) for c in CASES] + [("zigzag", "ring", torch.bfloat16)]


def build(attn="sdpa"):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)


def build_falcon(attn="sdpa"):
    import hf_tiny
    model = hf_tiny.build_falcon()
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model.train()


def falcon_one_device(dtype):
    model = build_falcon(causal_sdpa()).to(dtype)
    ids, labels = data()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.double() for n, p in model.named_parameters()}


def data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 3:9] = -100          # the first shard of row 0 keeps fewer labelled tokens
    return ids, labels


def one_device(dtype):
    model = build().to(dtype)
    ids, labels = data()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.double() for n, p in model.named_parameters()}


def grads(model):
    return {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()}


def refusal(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


class HandWrittenAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V written out: no scaled_dot_product_attention call."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / 8 ** 0.5
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def on_ranks(ctx):
    out = {}
    ids, labels = data()
    for layout, method, dtype in RUNS:
        model = ContextParallel(build().to(dtype), layout=layout, method=method)
        batch = context_parallel_batch(ids, labels, layout=layout)
        loss = batch.loss(model(**batch.inputs).logits)
        loss.backward()
        average_gradients(model.parameters(), tag="cp grads")
        out[layout, method, dtype] = dict(loss=loss.item(), grads=grads(model))
    # what a new user tries first: shard ids and labels, call the model as usual
    naive = ContextParallel(build())
    half = slice(ctx.rank * SEQ // 2, (ctx.rank + 1) * SEQ // 2)
    naive(input_ids=ids[:, half], labels=labels[:, half]).loss.backward()
    average_gradients(naive.parameters(), tag="naive grads")
    out["naive"] = dict(grads=grads(naive))
    eager = context_parallel_batch(ids, labels)
    out["eager"] = refusal(lambda: ContextParallel(build("eager"))(**eager.inputs))
    hand = nn.Sequential(nn.Linear(8, 8), HandWrittenAttention())
    out["hand"] = refusal(lambda: ContextParallel(hand)(torch.randn(1, 4, 8)))
    window = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, sliding_window=8)
    mistral = transformers.AutoModelForCausalLM.from_config(window)
    out["window"] = refusal(lambda: ContextParallel(mistral)(**eager.inputs))
    packed = context_parallel_batch(ids, labels, layout="zigzag")
    out["packed"] = refusal(lambda: ContextParallel(build(), layout="zigzag")(
        **packed.inputs, use_cache=False))
    out["falcon"] = refusal(lambda: ContextParallel(build_falcon(), layout="zigzag")(
        **packed.inputs))
    falcon = ContextParallel(build_falcon(causal_sdpa()), layout="zigzag")
    loss = packed.loss(falcon(**packed.inputs).logits)
    loss.backward()
    average_gradients(falcon.parameters(), tag="cp grads")
    out["falcon causal_sdpa"] = dict(loss=loss.item(), grads=grads(falcon))
    return out


@pytest.fixture(scope="module")
def runs():
    return labkit.launch(on_ranks, 2, timeout_s=300)


@pytest.mark.parametrize("layout, method, dtype", RUNS)
def test_llama_gradients_and_loss_equal_one_device(runs, layout, method, dtype):
    """bf16: judged by the bf16 single-device run's own error against float64."""
    single_loss, single = one_device(dtype)
    exact_loss, exact = one_device(torch.float64)
    for rank in range(2):
        mine = runs[rank][layout, method, dtype]
        agreement = numerics.compare(mine["grads"], single, exact)
        assert agreement, f"rank {rank} {layout} {method}: {agreement}"
        assert numerics.compare_loss([mine["loss"]], [single_loss], [exact_loss])


def test_sharding_ids_and_calling_the_model_as_usual_is_far_off(runs):
    _, single = one_device(torch.float32)
    _, exact = one_device(torch.float64)
    agreement = numerics.compare(runs[0]["naive"]["grads"], single, exact)
    assert agreement.error > 100 * agreement.limit   # measured: rms 3.4e-3, limit 1.5e-8


def test_eager_attention_refused_on_every_rank(runs):
    for rank in range(2):
        message = runs[rank]["eager"]
        assert message and "LlamaAttention (model.layers.0.self_attn) ran without" in message
        assert "\n" not in message


def test_hand_written_attention_refused_on_every_rank(runs):
    for rank in range(2):
        assert "HandWrittenAttention (1) ran without calling" in runs[rank]["hand"]


def test_packed_sequence_mask_refused_on_every_rank_before_the_ring(runs):
    """Rank 0 holds positions 0..3, 12..15 (a jump: transformers builds a packed-sequence
    4-D mask); rank 1 holds 4..11 (no mask). Both refuse; neither waits in the ring."""
    assert "got a 4-D attn_mask" in runs[0]["packed"]
    assert "another rank of the group cannot run this attention call" in runs[1]["packed"]
    assert all("\n" not in runs[r]["packed"] for r in range(2))


def test_sliding_window_shorter_than_the_sequence_refused_on_every_rank(runs):
    """Mistral with an 8-token window over 16 tokens: each 8-token shard fits in the window, so
    transformers builds no mask and the cores would attend causally over all 16: refused."""
    for rank in range(2):
        assert "sliding window of 8 tokens, shorter than the 16-token" in runs[rank]["window"]


def test_falcon_refusal_names_its_own_mask_and_its_advice_works(runs):
    """Falcon materialises its causal mask on every call (to add ALiBi to it): the refusal says
    so (not padding), and the model built as it advises equals one device."""
    for rank in range(2):
        message = runs[rank]["falcon"]
        assert "the model built its own causal attn_mask" in message and "\n" not in message
        assert "causal_sdpa()" in message and "padding" not in message
    single_loss, single = falcon_one_device(torch.float32)
    exact_loss, exact = falcon_one_device(torch.float64)
    for rank in range(2):
        mine = runs[rank]["falcon causal_sdpa"]
        agreement = numerics.compare(mine["grads"], single, exact)
        assert agreement, f"rank {rank}: {agreement}"
        assert numerics.compare_loss([mine["loss"]], [single_loss], [exact_loss])


def test_a_convolution_over_the_sequence_refused_in_one_line():
    """Mamba's, gated-delta-net's and short-conv layers run an nn.Conv1d along the sequence: on a
    shard it would see only this rank's tokens (the family matrix found Qwen3-Next, Mamba, LFM
    off by 2e-2 to 2e-1), so ContextParallel refuses it, naming it, before any group is used."""
    class ShortConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(8, 8, 4, groups=8, padding=3)

        def forward(self, x):
            return self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)

    with pytest.raises(ValueError, match=r"Conv1d conv \(kernel 4\) convolves along the "
                                         "sequence") as err:
        ContextParallel(ShortConv())
    assert "\n" not in str(err.value)
