"""A request stream served with a draft model (speculative decoding) or with its prefill on a
rank of its own (disaggregated prefill), each request's tokens checked against it served alone.

`run serve --requests N --draft-layers K [--draft-len K] [--replicas R]`: every rank serves
the requests whose id % R is its own, one at a time, with `speculative_generate`: the draft
is the target's own first K blocks and head (`early_exit_draft`, self-speculation; the lab's
models are random, so a separately built small model agrees with the target almost never).
Report: the acceptance rate measured (accepted / proposals examined), tokens per target
forward measured beside Leviathan et al.'s (1 - a^(k+1)) / (1 - a) at that rate, and
tokens_differing (must be 0: the output is the target's greedy output).
`run serve --requests N --prefill-ranks P`: ranks 0..P-1 prefill (request i on rank i % P)
and send its keys, values and first token to rank P, which decodes all running requests
between receives (`disaggregated_generate`; the requests in arrival order, their arrival
times not waited for). Report: each request's KV bytes sent, measured from the comm log, beside
2 x layers x kv_width x prompt x 4 bytes.
"""
from ..parallel.disaggregated import TAG, disaggregated_generate
from ..parallel.speculative import (early_exit_draft, expected_tokens_per_round,
                                    speculative_generate)
from ..theory import serving_stream as theory
from . import stream
from .serve import timed_launch, tokens_differing

# the stream options each mode takes; any other given explicitly is refused in one line
COMMON = {"requests", "rate", "trace", "stream_prompt_len", "stream_output_len", "seed",
          "json", "layers", "hidden", "heads", "ffn", "vocab", "world_size"}
ACCEPTS = dict(speculative=COMMON | {"draft_layers", "draft_len", "replicas"},
               disaggregated=COMMON | {"prefill_ranks", "block_size"})


def add_arguments(group):
    """--draft-layers, --draft-len and --prefill-ranks, in the stream's option group."""
    group.add_argument("--draft-layers", type=int, default=None, metavar="K",
                       help="speculative decoding, drafted by the model's own first K blocks "
                            "(not a separate draft model: the lab's random models have no "
                            "trained small sibling)")
    group.add_argument("--draft-len", type=int, default=None, metavar="K",
                       help="tokens the draft proposes per round (default 4)")
    group.add_argument("--prefill-ranks", type=int, default=None, metavar="N",
                       help="disaggregated prefill: N prefill ranks beside one decode rank")


def mode(args):
    """'speculative', 'disaggregated' or None (the batching engine); refuses in one line an
    option the mode cannot take."""
    spec, disagg = args.draft_layers is not None, args.prefill_ranks is not None
    if args.draft_len is not None and not spec:
        raise ValueError("--draft-len sets speculative decoding's proposals: give "
                         "--draft-layers K too")
    if not (spec or disagg):
        return None
    if args.requests is None and args.trace is None:
        raise ValueError("--draft-layers and --prefill-ranks serve a request stream: give "
                         "--requests N (or --trace FILE)")
    if spec and disagg:
        raise ValueError("--draft-layers and --prefill-ranks: one at a time (the decode rank "
                         "here decodes without a draft)")
    name = "speculative" if spec else "disaggregated"
    extra = sorted(set(getattr(args, "explicit", ())) - ACCEPTS[name])
    if extra:
        takes = ", ".join(sorted("--" + a.replace("_", "-") for a in ACCEPTS[name] - COMMON))
        raise ValueError(f"--{extra[0].replace('_', '-')} does not apply to {name} serving "
                         f"(it takes {takes} and the stream's options)")
    if disagg and args.prefill_ranks < 1:
        raise ValueError(f"--prefill-ranks must be a positive integer, got "
                         f"{args.prefill_ranks}")
    return name


def report(args, shape):
    """The mode's report (a dict) for `run serve` with these arguments."""
    name = mode(args)
    cfg = stream.config_from_args(args, shape)
    stream.check_config(cfg)
    layers = cfg.gpt_config().layers
    if name == "speculative":
        k = 4 if args.draft_len is None else args.draft_len
        if k < 1:
            raise ValueError(f"--draft-len must be a positive integer, got {k}")
        if not 1 <= args.draft_layers < layers:
            raise ValueError(f"--draft-layers keeps 1 to {layers - 1} of the model's {layers} "
                             f"blocks, got {args.draft_layers}")
        # the draft runs up to k positions past a request's end: the model has room for them
        if args.world_size not in (None, cfg.replicas):
            raise ValueError(f"speculative serving runs on --replicas {cfg.replicas} rank(s), "
                             f"not --world-size {args.world_size}: give --replicas "
                             f"{args.world_size} (or drop --world-size)")
        longest = max(r["prompt"] + r["output"] for r in cfg.stream())
        cfg.model_kwargs = dict(cfg.model_kwargs, seq=longest + k)
        return speculative_report(cfg, args.draft_layers, k)
    world = args.prefill_ranks + 1
    if args.world_size not in (None, world):
        raise ValueError(f"--prefill-ranks {args.prefill_ranks} runs on {world} ranks (the "
                         f"prefill ranks and one decode rank), not --world-size "
                         f"{args.world_size}")
    return disaggregated_report(cfg, args.prefill_ranks)


def _speculate(ctx, cfg, draft_layers, k):
    rows = cfg.stream()
    target, ids = stream.build_model(cfg, rows), stream.prompts(cfg, rows)
    draft = early_exit_draft(target, draft_layers)
    out = []
    for r in rows:
        if r["id"] % cfg.replicas == ctx.rank:
            tokens, stats = speculative_generate(target, draft, ids[r["id"]], r["output"], k)
            out.append(dict(id=r["id"], tokens=tokens, **stats))
    return dict(requests=out, backend=ctx.backend)


def speculative_report(cfg, draft_layers, k, timeout_s=300):
    rows = cfg.stream()
    results, wall = timed_launch(_speculate, cfg.replicas, cfg, draft_layers, k,
                                 timeout_s=timeout_s)
    served = {q["id"]: q for r in results for q in r["requests"]}
    differing = tokens_differing({i: q["tokens"] for i, q in served.items()},
                           stream.reference_tokens(cfg, rows))
    total = {key: sum(q[key] for q in served.values())
             for key in ("rounds", "proposed", "examined", "accepted", "target_forwards")}
    acceptance = total["accepted"] / max(1, total["examined"])
    out_tokens = sum(r["output"] for r in rows)
    return dict(technique="serve", mode="speculative", world_size=cfg.replicas,
                backend=results[0]["backend"], config=cfg.as_dict(),
                draft=dict(kind="early exit", layers=draft_layers, draft_len=k),
                requests=[dict(id=r["id"], prompt=r["prompt"], output=r["output"],
                               **{key: served[r["id"]][key] for key in (
                                   "rounds", "accepted", "examined", "acceptance")})
                          for r in rows],
                acceptance=acceptance, accepted_fraction=total["accepted"] / total["proposed"],
                # a round yields its accepted proposals and the target's own token (before
                # the last round is cut to the request's length): what the formula predicts
                tokens_per_round=(total["accepted"] + total["rounds"]) / max(1, total["rounds"]),
                expected_tokens_per_round=expected_tokens_per_round(acceptance, k),
                tokens_per_target_forward=out_tokens / total["target_forwards"],
                tokens_differing=int(differing), tokens_equal_reference=differing == 0,
                wall_s=wall)


def _disaggregate(ctx, cfg):
    rows = cfg.stream()
    model, ids = stream.build_model(cfg, rows), stream.prompts(cfg, rows)
    tokens = disaggregated_generate(model, [ids[r["id"]] for r in rows],
                                    [r["output"] for r in rows], block_size=cfg.block_size)
    sent = [rec.bytes for rec in ctx.comm.records if rec.tag == TAG and rec.op == "send"]
    return dict(tokens=tokens, kv_bytes_sent=sent, backend=ctx.backend)


def disaggregated_report(cfg, prefill_ranks=1, timeout_s=300):
    rows = cfg.stream()
    (*prefill, decode), wall = timed_launch(_disaggregate, prefill_ranks + 1, cfg,
                                            timeout_s=timeout_s)
    # prefill rank j sent requests j, j + P, j + 2P, ... in that order
    by_request = {j + i * prefill_ranks: b for j, r in enumerate(prefill)
                  for i, b in enumerate(r["kv_bytes_sent"])}
    sent = [by_request[r["id"]] for r in rows]
    gpt = cfg.gpt_config(rows)
    differing = tokens_differing(dict(enumerate(decode["tokens"])),
                                 stream.reference_tokens(cfg, rows))
    per_token = theory.kv_bytes_per_token(gpt.layers, gpt.hidden, 4)   # float32 keys, values
    predicted = [per_token * r["prompt"] for r in rows]
    return dict(technique="serve", mode="disaggregated", world_size=prefill_ranks + 1,
                prefill_ranks=prefill_ranks, backend=decode["backend"], config=cfg.as_dict(),
                requests=[dict(id=r["id"], prompt=r["prompt"], output=r["output"],
                               kv_bytes_sent=b, predicted_kv_bytes=p)
                          for r, b, p in zip(rows, sent, predicted)],
                kv_bytes_sent_per_request=sum(sent) / len(rows),
                predicted_kv_bytes_per_request=sum(predicted) / len(rows),
                kv_bytes_equal_formula=sent == predicted,
                tokens_differing=int(differing), tokens_equal_reference=differing == 0,
                wall_s=wall)


def format_report(r):
    """What the CLI prints without --json."""
    ranks = (f"{r['prefill_ranks']} prefill + 1 decode" if r["mode"] == "disaggregated"
             else f"{r['world_size']} replica(s)")
    head = (f"{len(r['requests'])} requests, {r['mode']} serving on {ranks}, "
            f"{r['backend']}; tokens differing from each request served alone: "
            f"{r['tokens_differing']}")
    if r["mode"] == "speculative":
        d = r["draft"]
        return "\n".join([head, f"  draft: the model's first {d['layers']} block(s), "
                          f"{d['draft_len']} proposals per round",
                          f"  acceptance (measured): {r['acceptance']:.2f} per examined "
                          f"proposal, {r['accepted_fraction']:.2f} of all proposals",
                          f"  tokens per round: {r['tokens_per_round']:.2f} measured, "
                          f"{r['expected_tokens_per_round']:.2f} by (1 - a^(k+1)) / (1 - a) at "
                          "that acceptance", f"  tokens per target forward (measured): "
                          f"{r['tokens_per_target_forward']:.2f}; wall {r['wall_s']:.1f} s"])
    return "\n".join([head, f"  KV bytes sent per request: {r['kv_bytes_sent_per_request']:,.0f}"
                      f" measured, {r['predicted_kv_bytes_per_request']:,.0f} by 2 x layers x "
                      f"width x prompt x 4 B (every request equal: "
                      f"{r['kv_bytes_equal_formula']})", f"  wall {r['wall_s']:.1f} s"])
