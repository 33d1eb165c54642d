"""The family matrix: every block on every decoder-only causal LM of the installed transformers.

Each family whose `AutoConfig.for_model` builds at miniature size (the blocks' self-check's
`shrunk_config`: 2 layers, 4 heads of 16, vocabulary 128; random weights, nothing downloaded;
dropout off) runs each block on 2 gloo ranks, and its result is set beside one device:
  DDP, FullyShard, TP (labkit's preset, else transformers' own plan), pipeline train, CP (ring,
  zigzag, SDPA), EP (MoE families): one SGD step (lr 1) on transformers' own loss, the whole
  parameters gathered and judged by labkit.numerics against the same step on one device in
  float32 and float64; pipeline generate and generate (labkit's serving loop): greedy tokens
  against transformers' own `generate`.
A cell is EQUAL (with the largest difference), REFUSED (labkit's one-line message: it said no
before anything ran wrong), WRONG (ran, and differs from one device: a silent wrong answer) or
ERROR (an exception that is not a labkit refusal, e.g. raised inside transformers).

    python scripts/family_matrix.py                    # every family -> docs/family-matrix.md
    python scripts/family_matrix.py llama falcon --blocks DDP,CP --out -
Cost: one 2-rank launch per chunk of families, ~5-20 s per family on 2 CPU cores.
"""
import argparse
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

BLOCKS = ("DDP", "FullyShard", "TP", "pipeline train", "pipeline generate", "CP", "generate",
          "EP")
VOCAB, BATCH, SEQ, PROMPT, NEW, LR = 128, 4, 8, 4, 4, 1.0
CHUNK, CHUNK_TIMEOUT_S, FAMILY_TIMEOUT_S = 4, 400, 200   # a hang ends; its family retried
DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate")
OUT = os.path.join(os.path.dirname(__file__), "..", "docs", "family-matrix.md")


# ------------------------------------------------------------------------ the tiny families

def causal_lm_families():
    """Model types transformers maps to a *ForCausalLM or *LMHeadModel class (GPT-2, CTRL,
    OpenAI GPT: decoder-only candidates; BERT-style ones are left out by `tiny_config`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
                  if isinstance(cls, str) and cls.endswith(("ForCausalLM", "LMHeadModel")))


def tiny_config(model_type):
    """The family's default config shrunk (self_check.shrunk_config, heads divisible by 2),
    dropout 0, no end-of-sequence token (every generation runs its full length)."""
    import transformers as hf
    from labkit.parallel.self_check import shrunk_config
    config = shrunk_config(hf.AutoConfig.for_model(model_type), divisor=2)
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError("an encoder-decoder model")
    if getattr(config, "is_decoder", None) is False and hasattr(config, "type_vocab_size"):
        raise TypeError("a BERT-style encoder (causal only with is_decoder=True)")
    if getattr(config, "rotary_dim", None):   # GPT-J, CodeGen: rotary over part of a head
        config.rotary_dim = min(config.rotary_dim, config.hidden_size
                                // config.num_attention_heads)
    if getattr(config, "num_experts_per_tok", 0) is None:   # DeepSeek-V2's default
        config.num_experts_per_tok = 2
    if getattr(config, "kv_lora_rank", None):   # latent attention: as many kv heads as q
        config.num_key_value_heads = config.num_attention_heads
    config.vocab_size = VOCAB
    for attr, value in list(vars(config).items()):
        if any(w in attr for w in DROPOUT_WORDS) and isinstance(value, float):
            setattr(config, attr, 0.0)
    for attr in ("bos_token_id", "pad_token_id"):
        if hasattr(config, attr):
            setattr(config, attr, 0)
    config.eos_token_id = None
    config.use_cache = True
    if hasattr(config, "output_router_logits"):   # the loss: cross entropy alone, as the
        config.output_router_logits = False       # pipeline's loss_fn computes it
    return config


def build(model_type, dtype=torch.float32, attn="sdpa"):
    """The tiny model, seeded (every rank and the reference build the same weights), in eval
    mode (no dropout, no router noise: every run computes one function), in `dtype`."""
    import transformers as hf
    config = tiny_config(model_type)
    torch.manual_seed(0)
    kwargs = dict(experts_implementation="eager")   # grouped_mm has no float64 kernel
    model = None
    for tried in ((attn, kwargs), (attn, {}), ("eager", {})):   # no SDPA, no experts switch
        try:
            torch.manual_seed(0)
            model = hf.AutoModelForCausalLM.from_config(config, attn_implementation=tried[0],
                                                        **tried[1])
            break
        except (ValueError, TypeError):
            if tried[0] == "eager":
                raise
    if model.generation_config is not None:
        model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)


def moe_blocks(model):
    """(parent, attribute) of every sparse MoE block (`experts` beside a `gate`/`router`)."""
    found = []
    for name, module in model.named_modules():
        for attr, child in module.named_children():
            if hasattr(child, "experts") and (hasattr(child, "gate") or hasattr(child, "router")):
                found.append((module, attr))
    return found


# ------------------------------------------------------------------------- on each rank

def _half(ids, rank):
    return ids[rank * BATCH // 2:(rank + 1) * BATCH // 2]


def _names(model):
    return {id(p): n for n, p in model.named_parameters()}


def _sgd_step(params, loss):
    optimizer = torch.optim.SGD(params, lr=LR)
    optimizer.zero_grad(set_to_none=True)
    loss().backward()
    return optimizer


def _ddp(ctx, model_type):
    from labkit.parallel.data_parallel import DataParallel
    model = build(model_type)
    wrapped = DataParallel(model)
    ids = _half(data(), ctx.rank)
    _sgd_step(model.parameters(), lambda: wrapped(input_ids=ids, labels=ids).loss).step()
    return dict(model.named_parameters())


def _fully_shard(ctx, model_type):
    from labkit.parallel.fully_shard import FullyShard
    sharded = FullyShard(build(model_type))
    ids = _half(data(), ctx.rank)
    _sgd_step(sharded.parameters(), lambda: sharded(input_ids=ids, labels=ids).loss).step()
    return sharded.full_state_dict()


def _tp(ctx, model_type):
    from labkit.parallel import tensor_parallel as tp
    model = tp.parallelize(build(model_type))
    ids = data()
    _sgd_step(model.parameters(), lambda: model(input_ids=ids, labels=ids).loss).step()
    with ctx.off_the_record():
        return tp.gather_params(model)


def next_token_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                           ids[:, 1:].reshape(-1))


def _pipeline_train(ctx, model_type):
    from labkit.parallel.pipeline import PipelineSchedule, PipelineStage, split_into_stages
    model = build(model_type)
    names = _names(model)
    stage = PipelineStage(split_into_stages(model, 2)[ctx.rank], ctx.rank, 2)
    pipe = PipelineSchedule(stage, n_microbatches=2, loss_fn=next_token_loss)
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    ids = data()
    pipe.step(ids if stage.is_first else None, target=ids if stage.is_last else None)
    optimizer.step()
    return {names[id(p)]: p for p in stage.parameters() if id(p) in names}


def _pipeline_generate(ctx, model_type):
    from labkit.parallel.pipeline import PipelineStage, split_into_stages
    from labkit.parallel.serving import PipelineGenerator
    model = build(model_type)
    stage = PipelineStage(split_into_stages(model, 2)[ctx.rank], ctx.rank, 2)
    generator = PipelineGenerator(stage, model.config.hidden_size, n_microbatches=2)
    with torch.no_grad():
        return generator.generate(data()[:, :PROMPT], NEW)


def _cp(ctx, model_type):
    from labkit.parallel.context_parallelism import ContextParallel, context_parallel_batch
    from labkit.parallel.flat import average_gradients
    model = build(model_type)
    wrapped = ContextParallel(model, layout="zigzag")
    batch = context_parallel_batch(data(), layout="zigzag")
    optimizer = _sgd_step(model.parameters(),
                          lambda: batch.loss(wrapped(**batch.inputs).logits))
    average_gradients(model.parameters(), tag="cp grads")
    optimizer.step()
    return dict(model.named_parameters())


def _generate(ctx, model_type):
    from labkit.parallel import serving
    with torch.no_grad():
        return serving.generate(build(model_type), data()[:, :PROMPT], NEW)


def _ep(ctx, model_type):
    from labkit.parallel.hf_experts import stack_experts
    from labkit.parallel.moe import ExpertParallel, average_moe_gradients, full_parameters
    model = build(model_type)
    blocks = moe_blocks(model)
    if not blocks:
        return None
    for parent, attr in blocks:
        setattr(parent, attr, ExpertParallel(getattr(parent, attr)))
    ids = _half(data(), ctx.rank)
    optimizer = _sgd_step(model.parameters(), lambda: model(input_ids=ids, labels=ids).loss)
    average_moe_gradients(model, None)
    optimizer.step()
    return stack_experts(full_parameters(model))


RUN = {"DDP": _ddp, "FullyShard": _fully_shard, "TP": _tp, "pipeline train": _pipeline_train,
       "pipeline generate": _pipeline_generate, "CP": _cp, "generate": _generate, "EP": _ep}


def _first_line(error):
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


def refused_by_labkit(error):
    """A labkit refusal: a ValueError/TypeError raised by a `raise` in labkit's own code."""
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, (ValueError, TypeError, NotImplementedError)) and bool(frames) \
        and f"{os.sep}labkit{os.sep}" in frames[-1].filename \
        and frames[-1].line.lstrip().startswith("raise")


def run_on_rank(ctx, families, blocks):
    """{family: {block: ("ran", value) | ("refused", line) | ("error", line)}} on this rank."""
    torch.set_num_threads(1)
    out = {}
    for family in families:
        out[family] = {}
        for block in blocks:
            try:
                value = RUN[block](ctx, family)
                value = {k: v.detach().clone() for k, v in value.items()} \
                    if isinstance(value, dict) else value
                out[family][block] = ("ran", value)
            except Exception as error:   # noqa: BLE001 - every outcome is a cell
                kind = "refused" if refused_by_labkit(error) else "error"
                out[family][block] = (kind, _first_line(error) if kind == "error"
                                      else str(error))
    return out


# ------------------------------------------------------------------------- one device

def one_device(model_type):
    """Parameters after the same SGD step on the whole batch, float32 and float64, and
    transformers' own greedy tokens."""
    ids, out = data(), {}
    for dtype in (torch.float32, torch.float64):
        model = build(model_type, dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        out[dtype] = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = build(model_type)
    prompt = ids[:, :PROMPT]
    with torch.no_grad():
        out["tokens"] = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                       do_sample=False, max_new_tokens=NEW,
                                       min_new_tokens=NEW, pad_token_id=0)[:, PROMPT:]
    return out


def judge(block, ranks, reference):
    """(verdict, detail) of one cell from both ranks' results and one device's."""
    kinds = {r[block][0] for r in ranks}
    if "refused" in kinds or "error" in kinds:
        kind = "refused" if "refused" in kinds else "error"
        message = next(r[block][1] for r in ranks if r[block][0] == kind)
        return ("REFUSED" if kind == "refused" else "ERROR", message)
    values = [r[block][1] for r in ranks]
    if values[0] is None:
        return ("n/a", "no MoE block")
    if block in ("pipeline generate", "generate"):
        same = all(torch.equal(v, reference["tokens"]) for v in values)
        differ = int((values[0] != reference["tokens"]).sum())
        return ("EQUAL", "tokens equal") if same else ("WRONG", f"{differ} tokens differ")
    from labkit import numerics
    params = {**values[0], **values[1]} if block == "pipeline train" else values[0]
    single, exact = reference[torch.float32], reference[torch.float64]
    if set(params) != set(single):
        missing = sorted(set(single) ^ set(params))[:3]
        return ("WRONG", f"parameter names differ from one device's: {missing}")
    agreement = numerics.compare(params, single, exact)
    others = [numerics.compare(v, single, exact) for v in values[1:]] \
        if block != "pipeline train" else []
    largest = max((params[n] - single[n]).abs().max().item() for n in single)
    if agreement and all(others):
        return ("EQUAL", f"{largest:.1e}")
    bad = agreement if not agreement else next(a for a in others if not a)
    return ("WRONG", f"max diff {largest:.1e}; {bad}")


# ------------------------------------------------------------------------- the matrix

def buildable(families):
    """({family: None}, {family: why not}) for the families that build and run a forward."""
    ok, skipped = [], {}
    for family in families:
        try:
            model = build(family)
            with torch.no_grad():
                model(input_ids=data()[:1])
            ok.append(family)
        except Exception as error:   # noqa: BLE001 - a family that does not build is listed
            skipped[family] = _first_line(error)
    return ok, skipped


def run_matrix(families, blocks=BLOCKS, chunk=CHUNK, log=print, not_run=None):
    """{family: {block: (verdict, detail)}}: chunks of families per 2-rank launch; a chunk
    that fails as a whole is run again family by family. A family whose launch dies (memory)
    or whose one-device reference fails gets no cells: `not_run[family]` says why."""
    from labkit.runtime.launch import LaunchError
    cells, not_run = {}, {} if not_run is None else not_run
    for start in range(0, len(families), chunk):
        part = families[start:start + chunk]
        began = time.perf_counter()
        try:
            results = _launch(part, blocks)
        except LaunchError:
            results = {}
            for family in part:
                try:
                    results.update(_launch([family], blocks, FAMILY_TIMEOUT_S))
                except LaunchError as error:
                    results[family] = None
                    not_run[family] = "the launch failed: " + str(error).splitlines()[0][:200]
        for family, ranks in results.items():
            if ranks is None:
                continue
            try:
                reference = one_device(family)
            except Exception as error:   # noqa: BLE001 - the reference itself fails
                not_run[family] = "one device (float64 or generate): " + _first_line(error)
                continue
            cells[family] = {b: judge(b, ranks, reference) for b in blocks}
        log(f"{', '.join(part)}: {time.perf_counter() - began:.0f} s")
    return cells


def _launch(families, blocks, timeout_s=CHUNK_TIMEOUT_S):
    import labkit
    ranks = labkit.launch(run_on_rank, 2, families, blocks, timeout_s=timeout_s)
    return {f: [r[f] for r in ranks] for f in families}


def count(cells):
    totals = {}
    for row in cells.values():
        for verdict, _ in row.values():
            totals[verdict] = totals.get(verdict, 0) + 1
    return totals


def markdown(cells, skipped, blocks, seconds):
    import transformers
    totals = count(cells)
    lines = [
        "# The family matrix",
        "",
        "Every block on every decoder-only causal LM of the installed transformers "
        f"({transformers.__version__}, torch {torch.__version__}) that builds from a tiny "
        "config: 2 layers, 4 heads of 16, vocabulary 128, random weights, nothing downloaded; "
        "2 gloo ranks against one device. Written by `make family-matrix` "
        f"(`scripts/family_matrix.py`, {seconds / 60:.0f} min on 2 CPU cores).",
        "",
        "Training cells: one SGD step (lr 1) on transformers' own loss, the whole parameters "
        "judged by labkit.numerics (rms error within 4x float32's own against float64); the "
        "number is the largest difference from one device in float32. Generation cells: "
        "greedy tokens against transformers' `generate`. REFUSED: labkit said no in one line "
        "before anything ran (messages below); WRONG: ran and differs from one device; ERROR: "
        "an exception that is not labkit's refusal; n/a: no MoE block.",
        "",
        "Totals: " + ", ".join(f"{v} {k}" for k, v in sorted(totals.items())) + ".",
        "",
        "| family | " + " | ".join(blocks) + " |",
        "| --- |" + " --- |" * len(blocks),
    ]
    for family in sorted(cells):
        row = cells[family]
        lines.append(f"| {family} | " + " | ".join(
            row[b][0] + (f" {row[b][1]}" if row[b][0] == "EQUAL" else "") for b in blocks)
            + " |")
    lines += ["", "## Messages", ""]
    for family in sorted(cells):
        for block in blocks:
            verdict, detail = cells[family][block]
            if verdict in ("REFUSED", "WRONG", "ERROR"):
                lines.append(f"- {family} / {block} ({verdict}): "
                             + detail.replace("|", "/").replace("\n", " "))
    lines += ["", f"## Not built or not run ({len(skipped)})", "",
              "Causal-LM model types whose default config does not build (or run a forward) at "
              "this size, whose 2-rank launch died, or whose one-device reference fails, with "
              "why:", ""]
    lines += [f"- {f}: {why.replace('|', '/')}" for f, why in sorted(skipped.items())]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types (default: every one)")
    parser.add_argument("--blocks", default=",".join(BLOCKS))
    parser.add_argument("--out", default=OUT, help="the markdown file ('-': print it)")
    args = parser.parse_args(argv)
    blocks = [b.strip() for b in args.blocks.split(",")]
    unknown = [b for b in blocks if b not in RUN]
    if unknown:
        parser.error(f"unknown blocks {unknown}; known: {', '.join(BLOCKS)}")
    began = time.perf_counter()
    families, skipped = buildable(args.families or causal_lm_families())
    print(f"{len(families)} families build, {len(skipped)} do not", flush=True)
    cells = run_matrix(families, blocks, log=lambda s: print(s, flush=True), not_run=skipped)
    text = markdown(cells, skipped, blocks, time.perf_counter() - began)
    if args.out == "-":
        print(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}: {count(cells)}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    main()
