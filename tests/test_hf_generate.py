"""labkit's `generate` on Hugging Face causal LMs (tiny, from configs, random weights): with HF's
own cache, the tokens of HF's `model.generate(do_sample=False)` on one device (Llama with GQA,
untied and tied head, Mistral, Qwen2, Phi-3, GPT-2, GPT-NeoX; sdpa and eager attention; fp32 and
bf16), on replicas and on tensor-parallel ranks (2 and 4); the cache's bytes measured from the
tensors against the formula; a forward that takes no cache refused in one line."""
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import labkit  # noqa: E402
from labkit import numerics  # noqa: E402
from labkit.parallel import serving, tensor_parallel as tp  # noqa: E402
from labkit.parallel.hf_cache import HFCache  # noqa: E402
import hf_tiny  # noqa: E402

NEW = 6
FAMILIES = [("llama", "sdpa", False), ("llama", "eager", False), ("llama", "sdpa", True),
            ("mistral", "sdpa", False), ("qwen2", "eager", False), ("gpt2", "eager", True),
            ("gpt2", "sdpa", True), ("gpt_neox", "sdpa", False), ("phi3", "eager", False)]


# ------------------------------------------------------------------------------ one device

@pytest.mark.parametrize("family,attn,tied", FAMILIES,
                         ids=[f"{f}-{a}{'-tied' if t else ''}" for f, a, t in FAMILIES])
def test_generate_gives_hf_generate_tokens_and_the_cache_bytes(family, attn, tied):
    model = hf_tiny.build(family, attn, tied)
    ids = hf_tiny.prompt()
    cache = serving.cache_for(model)
    tokens = serving.generate(model, ids, NEW, cache)
    assert torch.equal(tokens, hf_tiny.hf_generate(model, ids, NEW))
    assert isinstance(cache, HFCache) and cache.length == ids.shape[1] + NEW - 1
    # the last token is never fed, so the cache holds prompt + NEW - 1 positions
    assert cache.nbytes() == hf_tiny.kv_bytes(model, 4, ids.shape[1] + NEW - 1)


def test_bf16_generate_gives_hf_generate_tokens():
    model = hf_tiny.build("llama").to(torch.bfloat16)
    ids = hf_tiny.prompt()
    cache = serving.cache_for(model)
    assert torch.equal(serving.generate(model, ids, NEW, cache),
                       hf_tiny.hf_generate(model, ids, NEW))
    assert cache.nbytes() == hf_tiny.kv_bytes(model, 4, ids.shape[1] + NEW - 1, dtype_bytes=2)


def test_without_the_cache_gives_the_same_tokens():
    model = hf_tiny.build("qwen2")
    ids = hf_tiny.prompt()
    assert torch.equal(serving.generate_without_cache(model, ids, NEW),
                       serving.generate(model, ids, NEW))


class LogitsOnly(torch.nn.Module):
    """What a user writes to get logits out of an HF model: its forward takes no cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


def test_refuses_a_forward_without_a_cache():
    with pytest.raises(TypeError, match="LogitsOnly.forward takes no cache.*newest token"):
        serving.generate(LogitsOnly(hf_tiny.build("llama")), hf_tiny.prompt(), NEW)


def test_refuses_a_cache_of_the_other_kind():
    with pytest.raises(TypeError, match="LlamaForCausalLM takes a Hugging Face cache, not a "
                                        "KVCache"):
        serving.generate(hf_tiny.build("llama"), hf_tiny.prompt(), NEW, serving.KVCache())


# ----------------------------------------------------------------------------------- ranks

RANK_CASES = [("llama", "sdpa", False), ("llama", "eager", True), ("gpt2", "eager", True),
              ("qwen2", "sdpa", False), ("phi3", "sdpa", False)]


def on_ranks(ctx, cases):
    """Per case: replicas (each rank its share of the requests) and TP (the preset plan); the
    tokens and logits of each, and the bytes of the cache each rank used."""
    out = {}
    ids = hf_tiny.prompt(batch=4)
    for family, attn, tied in cases:
        mine = serving.split_requests(ids)
        cache = serving.cache_for(hf_tiny.build(family, attn, tied))
        replica = serving.generate(hf_tiny.build(family, attn, tied), mine, NEW, cache)
        split = tp.parallelize(hf_tiny.build(family, attn, tied))
        tp_cache = serving.cache_for(split)
        tokens, logits = serving.generate(split, ids, NEW, tp_cache, return_logits=True)
        out[(family, attn, tied)] = dict(
            replicas=serving.gather_requests(replica), replica_bytes=cache.nbytes(),
            tp=tokens, tp_logits=logits, tp_bytes=tp_cache.nbytes())
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return labkit.launch(on_ranks, 2, RANK_CASES, timeout_s=300)


def _single(family, attn, tied):
    """HF's tokens, and the float32 and float64 logits of the same greedy path."""
    model = hf_tiny.build(family, attn, tied)
    ids = hf_tiny.prompt(batch=4)
    tokens, logits = serving.generate(model, ids, NEW, return_logits=True)
    exact_tokens, exact = serving.generate(numerics.exact_copy(model), ids, NEW,
                                           return_logits=True)
    assert torch.equal(tokens, exact_tokens)   # no near-tie: the comparison below is fair
    return hf_tiny.hf_generate(model, ids, NEW), logits, exact, model


@pytest.mark.parametrize("case", RANK_CASES, ids=[f"{f}-{a}{'-tied' if t else ''}"
                                                 for f, a, t in RANK_CASES])
def test_replicas_and_tp_give_hf_generate_tokens(two_ranks, case):
    reference, logits, exact, model = _single(*case)
    tokens_len = hf_tiny.prompt().shape[1] + NEW - 1
    for rank, result in enumerate(two_ranks):
        r = result[case]
        assert torch.equal(r["replicas"], reference)
        assert r["replica_bytes"] == hf_tiny.kv_bytes(model, 2, tokens_len)   # 2 requests each
        assert torch.equal(r["tp"], reference)
        assert r["tp_bytes"] == hf_tiny.kv_bytes(model, 4, tokens_len, tp=2)  # its kv heads
        agreement = numerics.compare(r["tp_logits"], logits, exact)
        assert agreement, (rank, str(agreement))


def on_four(ctx):
    model = tp.parallelize(hf_tiny.build("llama", heads=8, kv_heads=4, hidden=64))
    cache = serving.cache_for(model)
    return serving.generate(model, hf_tiny.prompt(), NEW, cache), cache.nbytes()


def test_tp_on_four_ranks_gives_hf_generate_tokens():
    model = hf_tiny.build("llama", heads=8, kv_heads=4, hidden=64)
    reference = hf_tiny.hf_generate(model, hf_tiny.prompt(), NEW)
    for tokens, nbytes in labkit.launch(on_four, 4, timeout_s=300):
        assert torch.equal(tokens, reference)
        assert nbytes == hf_tiny.kv_bytes(model, 4, hf_tiny.prompt().shape[1] + NEW - 1, tp=4)
