"""Serving labkit's GPT on ranks: greedy generation with a KV cache, checked against one device.

`python -m labkit run serve --tp 2 [--pp 2] [--replicas 2] [--experts 8 --ep 2]
 --prompt-len 16 --new-tokens 8 --batch 8 [--json]`. The world is a mesh dp=replicas (x ep)
by pp by tp, laid out by `labkit.parallel.hybrid.HybridGenerator`: each replica gets its
share of the requests; inside it the model is split by `parallelize_module` (heads and MLP
columns) over TP, cut by `split_into_stages` over PP and run by `PipelineGenerator` (the
requests in pp micro-batches), or, for the MoE GPT, its experts spread by `ExpertParallel` over
EP (attention replicated, requests split). The report adds to the run report:
tokens_equal_reference (greedy tokens of every request vs one device), kv_cache_bytes
(measured, per rank) beside the formula, comm per generated token by group, wall tokens/s here
and the modelled TTFT / TPOT of the same layout on the chosen cluster (labkit.theory.serving).
Before any rank starts, `check_config` refuses in one line a layout the blocks cannot take and
a run that cannot fit in memory here or end within its timeout (runs/serve_fit.py).
"""
import time
from dataclasses import dataclass, field, asdict, replace

import torch

from .. import models
from ..parallel.hybrid import HybridGenerator
from ..parallel.moe import check_expert_parallel
from ..parallel.serving import comm_per_token, gather_requests, generate, new_cache
from ..parallel.tensor_parallel_plan import resolve_plan
from ..runtime.launch import launch
from ..theory import serving as theory
from .serve_fit import check_fits
from ..parallel.tensor_parallel_plan import gpt_plan

GPT_TP_PLAN = gpt_plan(vocab=False)   # embedding and head whole: each rank picks the token
SHAPE = dict(layers=4, heads=4, hidden=64, ffn=256)   # the served GPT unless told otherwise
BYTES = 4   # the tiny models run in float32
TIMEOUT_S = 300   # the ranks' limit: a generation of this tiny GPT takes seconds


@dataclass
class ServeConfig:
    """One serving run: the layout, the requests, and the model's shape."""
    tp: int = 1
    pp: int = 1
    replicas: int = 1
    experts: int = 0          # 0: the dense GPT; else the MoE GPT with this many experts
    ep: int = 1
    top_k: int = 1
    batch: int = 8
    prompt_len: int = 16
    new_tokens: int = 8
    seed: int = 0
    model_kwargs: dict = field(default_factory=dict)

    @property
    def world_size(self):
        return self.replicas * self.ep * self.tp * self.pp

    def gpt_config(self):
        return gpt_shape(self.model_kwargs, self.prompt_len + self.new_tokens)

    def moe_config(self):
        # serving drops no token: capacity for every assignment (factor E / k)
        return models.MoEConfig(experts=self.experts, top_k=self.top_k,
                                capacity_factor=self.experts / self.top_k)

    def as_dict(self):
        return asdict(self)


def gpt_shape(model_kwargs, tokens):
    """The served GPT's config: SHAPE with the run's own sizes, room for `tokens` positions."""
    shape = dict(SHAPE, **model_kwargs)
    shape["seq"] = max(shape.get("seq", 0), tokens)
    return models.GPTConfig(**shape)


def timed_launch(fn, world_size, *args, **options):
    """`launch(fn, world_size, *args, **options)`'s results and the wall seconds it took
    (starting the ranks included: what a serving report calls `wall_s`)."""
    start = time.perf_counter()
    results = launch(fn, world_size, *args, **options)
    return results, time.perf_counter() - start


def tokens_differing(got, ref):
    """Tokens of {request: tokens} that differ from the reference's, a missing or extra token
    counting as one: 0 when every request is served as it is alone."""
    return sum(sum(a != b for a, b in zip(got[i], ref[i])) + abs(len(got[i]) - len(ref[i]))
               for i in ref)


def check_config(cfg, world_size=None, timeout_s=TIMEOUT_S):
    """Everything checkable before ranks start, one line each: the layout, and whether the run
    fits in memory here and ends within `timeout_s` (runs/serve_fit.py)."""
    for name in ("tp", "pp", "replicas", "ep", "batch", "prompt_len", "new_tokens", "top_k"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer")
    if world_size is not None and world_size != cfg.world_size:
        raise ValueError(f"--world-size {world_size} is not replicas x ep x tp x pp = "
                         f"{cfg.world_size}")
    c = cfg.gpt_config()
    if cfg.experts:
        if cfg.tp > 1 or cfg.pp > 1:
            raise ValueError("the MoE GPT serves with --ep and --replicas here (not --tp/--pp)")
        check_expert_parallel(cfg.experts, cfg.top_k, None, cfg.ep)
    elif cfg.ep > 1:
        raise ValueError("--ep spreads experts: give --experts E too")
    check_fits(cfg, timeout_s)
    # the block's own check, on a model with no storage and at most two blocks: the plan reads
    # the names of one block's modules, and 100,000 meta blocks take minutes to build
    with torch.device("meta"):
        resolve_plan(models.TinyGPT(replace(c, layers=min(c.layers, 2))), GPT_TP_PLAN, cfg.tp)
    if cfg.pp > c.layers + 2:
        raise ValueError(f"--pp {cfg.pp} is more stages than the {c.layers + 2} pieces of the "
                         "model (embedding, each block, norm + head)")
    share = cfg.replicas * cfg.ep
    if cfg.batch % share or (cfg.batch // share) % cfg.pp:
        raise ValueError(f"--batch {cfg.batch} must split over {share} replica(s) and then "
                         f"into {cfg.pp} micro-batch(es)")


def build(cfg):
    """The single-device model (same seed on every rank)."""
    if cfg.experts:
        return models.build_moe(cfg.seed, moe=cfg.moe_config(), **cfg.gpt_config().as_dict())
    return models.build("gpt", seed=cfg.seed, **cfg.gpt_config().as_dict())


def requests(cfg):
    """The (batch, prompt_len) prompt ids every rank and the reference see."""
    g = torch.Generator().manual_seed(1000 + cfg.seed)
    return torch.randint(0, cfg.gpt_config().vocab, (cfg.batch, cfg.prompt_len), generator=g)


def reference(cfg):
    """Greedy tokens, their logits and the KV-cache bytes on one device."""
    cache = new_cache()
    tokens, logits = generate(build(cfg).eval(), requests(cfg), cfg.new_tokens, cache,
                              return_logits=True)
    return dict(tokens=tokens, logits=logits, kv_cache_bytes=cache.nbytes())


def serve(ctx, cfg):
    """This rank's part of the generation; returns its tokens (all requests), cache bytes,
    comm log and timings."""
    mesh = ctx.mesh(dp=cfg.replicas * cfg.ep, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep)
    server = HybridGenerator(build(cfg).eval(), mesh, GPT_TP_PLAN, expert_parallel=cfg.experts > 0)
    start = time.perf_counter()
    tokens = server.generate(requests(cfg), cfg.new_tokens)
    wall = time.perf_counter() - start
    held, cache_bytes = server.held, server.cache_bytes
    layers_here = (sum(isinstance(m, models.Block) for m in held) if cfg.pp > 1
                   else cfg.gpt_config().layers)
    with ctx.off_the_record():
        everyone = gather_requests(tokens, mesh["dp"])
    params = sum(p.nbytes for p in held.parameters())   # the weights this rank serves with
    return dict(rank=ctx.rank, tokens=everyone, kv_cache_bytes=cache_bytes, wall_s=wall,
                memory=dict(params=params, kv_cache=cache_bytes, total=params + cache_bytes),
                layers_here=layers_here, requests_here=server.requests_here,
                comm=ctx.comm.summary(by=("op", "group", "tag")), backend=ctx.backend,
                cluster=ctx.clock.cluster.name)


def report(world_size=None, cfg=None, cluster="8xH100-NVLink", timeout_s=TIMEOUT_S):
    """Run the serving layout, compare with one device, and return the report (a dict)."""
    cfg = cfg or ServeConfig()
    check_config(cfg, world_size, timeout_s)
    results, wall = timed_launch(serve, cfg.world_size, cfg, cluster=cluster,
                                 timeout_s=timeout_s)
    ref = reference(cfg)
    tokens = results[0]["tokens"]
    equal = all(torch.equal(r["tokens"], ref["tokens"]) for r in results)
    gen_s = max(r["wall_s"] for r in results)
    times = theory.tiny_gpt_serving_time(
        **cfg.gpt_config().as_dict(), experts=cfg.experts, top_k=cfg.top_k, cluster=cluster,
        tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, replicas=cfg.replicas, batch=cfg.batch,
        prompt_len=cfg.prompt_len, new_tokens=cfg.new_tokens)
    return dict(
        technique="serve", world_size=cfg.world_size, backend=results[0]["backend"],
        cluster=cluster, config=cfg.as_dict(),
        tokens_equal_reference=equal,
        tokens_differing=int((tokens != ref["tokens"]).sum()),
        memory={r["rank"]: r["memory"] for r in results},
        kv_cache_bytes={r["rank"]: r["kv_cache_bytes"] for r in results},
        predicted_kv_cache_bytes={r["rank"]: theory.cached_kv_bytes(
            layers=r["layers_here"], requests=r["requests_here"], prompt_len=cfg.prompt_len,
            new_tokens=cfg.new_tokens, hidden=cfg.gpt_config().hidden, tp=cfg.tp,
            bytes_per_value=BYTES) for r in results},
        reference_kv_cache_bytes=ref["kv_cache_bytes"],
        comm=comm_per_token(results[0]["comm"], cfg.new_tokens),
        comm_by_rank={r["rank"]: comm_per_token(r["comm"], cfg.new_tokens) for r in results},
        wall_s=wall, generation_wall_s=gen_s,
        wall_tokens_per_s=cfg.batch * cfg.new_tokens / gen_s,
        wall_s_per_token=gen_s / cfg.new_tokens,
        modelled_ttft_s=times["ttft_s"], modelled_tpot_s=times["tpot_s"],
        modelled_tokens_per_s=times["tokens_per_s"], tokens=tokens)


def add_arguments(parser):
    """The `run serve` options (the CLI adds the shape flags and --json)."""
    for name, default, help_text in (
            ("tp", 1, "tensor-parallel degree (heads and MLP split)"),
            ("pp", 1, "pipeline stages (requests in pp micro-batches)"),
            ("replicas", 1, "independent copies, the requests split"),
            ("experts", 0, "serve the MoE GPT with this many experts"),
            ("ep", 1, "expert-parallel degree (with --experts)"),
            ("top-k", 1, "experts per token (with --experts)"),
            ("prompt-len", 16, "prompt tokens per request"),
            ("new-tokens", 8, "tokens generated per request"),
            ("batch", 8, "requests")):
        parser.add_argument(f"--{name}", type=int, default=default, help=help_text)


def config_from_args(args, shape):
    return ServeConfig(tp=args.tp, pp=args.pp, replicas=args.replicas, experts=args.experts,
                       ep=args.ep, top_k=args.top_k, batch=args.batch,
                       prompt_len=args.prompt_len, new_tokens=args.new_tokens, seed=args.seed,
                       model_kwargs=shape)
