"""Serving: greedy generation with a KV cache, on one device, on replicas and through a pipeline.

The idea (Pope et al. 2022, "Efficiently Scaling Transformer Inference", arXiv 2211.05102).
Generation runs the model once on the prompt ("prefill": P tokens per request at once, the
matmuls see b*P rows, compute-bound) and then once per new token ("decode": one row per request,
so every weight and every cached key/value is read from memory for b rows: bandwidth-bound).
The KV cache keeps each attention layer's keys and values, so a decode step computes only the
new token's q, k, v: 2 x layers x b x tokens x kv_width x bytes, growing with every token of
every request.

The model is any module called `model(ids, kv_cache=cache)` -> logits (labkit's TinyGPT, or a
decoder written with labkit's `Attention`), or a Hugging Face causal LM with its own cache
(`past_key_values`/`cache` + `use_cache`, output `.logits`: hf_cache.py). A forward that takes
no cache is refused: fed only the newest token it would forget the prompt. The layouts compose
the training blocks:
- tensor parallel: the same `generate` on a model split by `parallelize` (heads and MLP columns;
  the cache is sharded by heads because each rank's k, v are narrower): 2 all-reduces of b x h
  per layer per decode step (after attention and after the MLP), on the critical path;
- replicas (data parallel): each rank generates its share of the requests (`split_requests`);
  no communication at all while generating;
- pipeline: `PipelineGenerator` on a stage from `split_into_stages` (duck-typed: `.module`,
  `.stage_index`, `.num_stages`, `.group`): the requests are cut into micro-batches that follow
  each other through the stages, each micro-batch with its own cache on every stage; the last
  stage picks the next token and sends it back to the first: per decode step and micro-batch,
  one b_m x h activation per stage boundary and b_m token ids around the ring;
- experts: `generate` on a model whose MoE layers are `ExpertParallel` (requests split as for
  replicas, attention replicated): 2 all-to-alls of the b x k routed rows per layer and step.
"""
import inspect

import torch
import torch.nn as nn

from ..runtime.context import context
from .hf_cache import HFCache, cache_argument
from .kv_cache import KVCache


def _accepts_cache(module):
    return "kv_cache" in inspect.signature(module.forward).parameters


def _takes_cache(model):
    return _accepts_cache(model) or (isinstance(model, nn.Sequential)
                                     and any(_accepts_cache(layer) for layer in model))


def cache_for(model, cache=None):
    """The cache `generate` feeds `model` (`cache`, or a new one of the kind the model takes:
    KVCache for `kv_cache=`, HFCache for a Hugging Face model); one-line TypeError for a
    forward that takes no cache, or a cache of the other kind."""
    name = type(model).__name__
    hf = cache_argument(model) is not None
    if not hf and not _takes_cache(model):
        raise TypeError(f"generate: {name}.forward takes no cache (no kv_cache, past_key_values "
                        "or cache parameter): fed only the newest token it would forget the "
                        "prompt (generate_without_cache recomputes the whole sequence instead)")
    if cache is None:
        return HFCache() if hf else new_cache()
    if hf != isinstance(cache, HFCache):
        raise TypeError(f"generate: {name} takes {'a Hugging Face' if hf else 'a kv_cache'} "
                        f"cache, not a {type(cache).__name__} (pass cache=None for a new one)")
    return cache


def model_positions(model):
    """The positions `model` can embed (TinyGPT's `pos` table, also as an nn.Sequential; a
    Hugging Face config's max_position_embeddings), or None when it does not say."""
    first = model[0] if isinstance(model, nn.Sequential) and len(model) else model
    pos = getattr(first, "pos", None)
    if isinstance(pos, nn.Embedding):
        return pos.num_embeddings
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) else None


def _logits(out):
    return out.logits if hasattr(out, "logits") else out   # a Hugging Face ModelOutput


def _run(module, x, cache):
    """Run `module` (or each layer of an nn.Sequential that does not take a cache itself)."""
    if isinstance(cache, HFCache):
        try:
            return cache.forward(module, x)
        except (RuntimeError, IndexError) as error:   # a family whose cache is not HF's layout
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ValueError(f"generate: {type(module).__name__} failed on transformers' cache "
                             f"as labkit passes it ({type(error).__name__}: {first}); its forward "
                             "keeps its own cache layout: use model.generate") from None
    if _accepts_cache(module):
        return module(x, kv_cache=cache)
    if isinstance(module, nn.Sequential):
        for layer in module:
            x = layer(x, kv_cache=cache) if _accepts_cache(layer) else layer(x)
        return x
    return module(x)


@torch.no_grad()
def generate(model, prompt, new_tokens, cache=None, return_logits=False, pick=None):
    """Greedy generation: (b, P) prompt ids -> (b, new_tokens) ids, prefill then decode.

    cache: the KVCache (HFCache for a Hugging Face model) to fill (default: a new one of the
    kind `model` takes; `cache_for` refuses a forward that takes none). return_logits: also the
    (b, new_tokens, vocab) logits each token was picked from (to compare with a reference
    within float tolerance). pick: (b, V) logits -> (b,) ids, default argmax (a head whose
    logits stay split by vocabulary passes `vocab_parallel_argmax`)."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"generate: new_tokens must be a positive integer, got {new_tokens!r}")
    if not isinstance(prompt, torch.Tensor) or prompt.ndim != 2 or 0 in prompt.shape:
        shape = tuple(prompt.shape) if isinstance(prompt, torch.Tensor) else \
            type(prompt).__name__
        raise ValueError(f"generate: prompt must be a (batch, length) tensor of token ids with "
                         f"at least one token, got {shape}")
    positions = model_positions(model)
    if positions is not None and prompt.shape[1] + new_tokens - 1 > positions:
        raise ValueError(f"generate: prompt {prompt.shape[1]} + new_tokens {new_tokens} - 1 "
                         f"positions exceed the model's {positions} (its position embedding); "
                         "ask for fewer new_tokens or build the model with a longer seq")
    cache = cache_for(model, cache)
    ids, tokens, logits = prompt, [], []
    for _ in range(new_tokens):
        out = _run(model, ids, cache)[:, -1]
        ids = (out.argmax(dim=-1) if pick is None else pick(out)).unsqueeze(1)
        tokens.append(ids)
        logits.append(out)
    tokens = torch.cat(tokens, dim=1)
    return (tokens, torch.stack(logits, dim=1)) if return_logits else tokens


@torch.no_grad()
def generate_without_cache(model, prompt, new_tokens):
    """The same greedy tokens computed the slow way: the whole sequence again every step."""
    ids = prompt
    for _ in range(new_tokens):
        ids = torch.cat([ids, _logits(model(ids))[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids[:, prompt.shape[1]:]


def new_cache():
    return KVCache()


def split_requests(requests, group=None):
    """This rank's contiguous share of the (b, ...) requests (replicas, expert parallelism)."""
    group = context().group(group)
    if requests.shape[0] % group.size:
        raise ValueError(f"{requests.shape[0]} requests do not split evenly over "
                         f"{group.size} replicas")
    return requests.chunk(group.size)[group.rank]


def gather_requests(tokens, group=None, tag="gather tokens"):
    """Every rank's generated tokens in request order (to check them; not part of serving)."""
    return context().comm.all_gather(tokens.contiguous(), group=group, tag=tag)


def comm_per_token(rows, new_tokens):
    """Per group and op: calls, payload bytes and ring wire bytes per rank, per generated
    token (payloads measured; wire bytes modelled)."""
    out = {}
    for row in rows:
        key = (row["group"], row["op"])
        acc = out.setdefault(key, dict(group=row["group"], op=row["op"], calls=0, bytes=0,
                                       wire_bytes_per_rank=0.0))
        for k in ("calls", "bytes", "wire_bytes_per_rank"):
            acc[k] += row[k]
    return [dict(r, calls_per_token=r["calls"] / new_tokens,
                 bytes_per_token=r["bytes"] / new_tokens,
                 wire_bytes_per_rank_per_token=r["wire_bytes_per_rank"] / new_tokens)
            for r in out.values()]


class PipelineGenerator:
    """Greedy generation through the stages of a pipeline, the requests in micro-batches.

    stage: this rank's stage (one per rank of `stage.group`); hidden: the width of the
    activations between stages. Round t (t = 0 is the prefill) runs micro-batch m = 0..M-1 on
    every stage in turn; the first stage waits for micro-batch m's token of round t-1, which the
    last stage sent back as soon as it had it, so with M >= stages every stage is busy.
    """

    def __init__(self, stage, hidden, n_microbatches=1):
        self.stage, self.hidden, self.n_microbatches = stage, hidden, n_microbatches
        self.group = context().group(stage.group)
        if stage.num_stages != self.group.size:
            raise ValueError(f"PipelineGenerator runs one stage per rank: {stage.num_stages} "
                             f"stages over {self.group.size} ranks")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        self.caches = []

    @torch.no_grad()
    def generate(self, prompt, new_tokens):
        """prompt: the (b, P) requests (only the first stage reads the ids, the others their
        shape). Returns the (b, new_tokens) tokens on every rank of the group (the last stage
        broadcasts them at the end, off the record: not serving traffic)."""
        comm, stage, group = context().comm, self.stage, self.group
        b, p = prompt.shape
        m_count = self.n_microbatches
        if b % m_count:
            raise ValueError(f"{b} requests do not split into {m_count} equal micro-batches")
        mb = b // m_count
        prev, nxt = stage.stage_index - 1, stage.stage_index + 1
        first, last = 0, stage.num_stages - 1
        self.caches = [new_cache() for _ in range(m_count)]
        inputs = list(prompt.chunk(m_count))
        tokens = [[] for _ in range(m_count)]
        pending = []
        for t in range(new_tokens):
            for m in range(m_count):
                seq = p if t == 0 else 1
                if stage.is_first:
                    x = inputs[m]
                    if t > 0 and not stage.is_last:   # the token the last stage sent back
                        x = comm.recv(torch.empty(mb, 1, dtype=torch.int64), last, group,
                                      tag="token back")
                else:
                    x = comm.recv(torch.empty(mb, seq, self.hidden), prev, group,
                                  tag="activation")
                y = _run(stage.module, x, self.caches[m])
                if not stage.is_last:
                    pending.append(comm.send(y.contiguous(), nxt, group, async_op=True,
                                             tag="activation"))
                    continue
                token = y[:, -1].argmax(dim=-1, keepdim=True)
                tokens[m].append(token)
                if stage.is_first:
                    inputs[m] = token
                elif t < new_tokens - 1:
                    pending.append(comm.send(token, first, group, async_op=True,
                                             tag="token back"))
            for handle in pending:
                handle.wait()
            pending = []
        out = (torch.cat([torch.cat(ts, dim=1) for ts in tokens]) if stage.is_last
               else torch.empty(b, new_tokens, dtype=torch.int64))
        with context().off_the_record():    # handing the result out is not serving
            return comm.broadcast(out, src=last, group=group, tag="result")

    def cache_bytes(self):
        return sum(c.nbytes() for c in self.caches)
