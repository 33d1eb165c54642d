"""Lesson 11's exercise: write the tensor-parallel plan (a dict {module name glob: style}) for a
Hugging Face family the lab has no preset for, Phi (transformers' `PhiForCausalLM`: q_proj,
k_proj, v_proj and `dense` in attention, `fc1`/`fc2` in the MLP), built from a tiny config.

The checker reads the plan against the model's layers first (Megatron's layout, Shoeybi et al.
2019, arXiv 1909.08053: the first layer of each pair colwise, the second rowwise, so each block
costs 2 all-reduces forward), then runs it: 2 AdamW steps on 2 ranks against one device in
float32 and float64, judged by `labkit.numerics` (losses and gathered parameters). Each
plausible wrong plan gets its own message: column and row swapped, a layer missed (whole on
every rank: right but not split, or a broken pair), the attention module planned as if it were
one fused projection, another family's fused projections (Phi-3's qkv_proj, gate_up_proj:
split part by part there, absent here), names without their `model.` prefix, lm_head rowwise
(its input is whole) or colwise (the logits left split, which the loss cannot take), a key that
names no layer; what the run gave (labkit's refusal, whole, before anything ran; an error of
the run; numbers that differ from one device) is said with it.
"""
import torch

from . import Check, Hints, not_started, say, show, with_hint

STEPS = 2
VOCAB = 128
# the role of each layer a Phi decoder has, by the last part of its name
PAIRS = {"q_proj": "dense", "k_proj": "dense", "v_proj": "dense", "fc1": "fc2"}
COLWISE, ROWWISE = ("q_proj", "k_proj", "v_proj", "fc1"), ("dense", "fc2")
VOCAB_LAYERS = ("embed_tokens", "lm_head")
FUSED_ELSEWHERE = ("qkv_proj", "gate_up_proj", "c_attn", "query_key_value", "qkv", "W_pack")
SOLUTION = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.dense": "rowwise",
    "model.layers.*.mlp.fc1": "colwise",
    "model.layers.*.mlp.fc2": "rowwise",
    "lm_head": "vocab",
}


def build_phi(seed=0):
    """A 2-layer Phi (4 query heads, 2 key/value heads, partial rotary), random weights from
    `seed`, nothing downloaded; dropout off so ranks and one device compute the same thing."""
    import transformers as hf
    config = hf.PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0,
                          attention_dropout=0.0, bos_token_id=0, eos_token_id=None,
                          pad_token_id=0, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(seed)
    return hf.AutoModelForCausalLM.from_config(config).train()


def _train(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, foreach=False)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(step))
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _run_plans(ctx, plans):
    """On each rank: each plan's 2 steps against one device (float32, float64), and the bytes
    of parameters this rank holds."""
    from .. import numerics
    from ..parallel import tensor_parallel as tp
    from ..parallel.parallel_styles import parallelize_module
    single = build_phi()
    exact = numerics.exact_copy(build_phi())
    reference = (_train(single), _train(exact))
    params = [dict(m.named_parameters()) for m in (single, exact)]
    whole = sum(p.numel() * p.element_size() for p in single.parameters())
    out = []
    for plan in plans:
        model = build_phi()
        stage = "refused"   # an error in parallelize_module is labkit refusing the plan
        try:
            parallelize_module(model, None, plan, verify=False)   # this checker is the check
            stage = "raised"        # after it, the run itself failed (a shape, the loss)
            losses = _train(model)
            with ctx.off_the_record():
                full = tp.gather_params(model)
        except Exception as error:  # noqa: BLE001 - the learner's plan: report, never crash
            out.append(dict(error=f"{type(error).__name__}: {str(error).splitlines()[0]}",
                            stage=stage))
            continue
        loss = numerics.compare_loss(losses, *reference)
        agree = numerics.compare(full, *params)
        out.append(dict(ok=bool(loss) and bool(agree), loss=str(loss), params=str(agree),
                        bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                        whole=whole))
    return out


HINTS = Hints(
    concept="in each pair the first layer splits its outputs (colwise: q_proj, k_proj, v_proj "
            "by heads, fc1 by features) and the second its inputs (rowwise: dense, fc2), so "
            "the pair needs one all-reduce; the embedding and lm_head split by vocabulary. "
            "print(model) shows the names.",
    code="plan = " + "{\n    " + ",\n    ".join(f"{k!r}: {v!r}" for k, v in SOLUTION.items())
         + ",\n}")


def show_solution(exercise=1):
    """Print the plan."""
    show({1: HINTS}, exercise)


def _layers(model):
    """{name: leaf} of the layers a plan may name (Linear and Embedding)."""
    return {name: name.rsplit(".", 1)[-1] for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}


def _planned(model, plan):
    """{layer name: style} the plan gives each layer (globs matched atom by atom)."""
    from ..parallel.tensor_parallel_plan import _matches
    return {name: style for name in _layers(model) for pattern, style in plan.items()
            if _matches(pattern, name)}


def _read_plan(model, plan):
    """The first mistake a reading of the plan finds, as (problem, message), or None."""
    from ..parallel.tensor_parallel_plan import _matches
    modules = dict(model.named_modules())
    unprefixed = [p for p in plan if not any(_matches(p, n) for n in modules)
                  and any(_matches("model." + p, n) for n in modules)]
    if unprefixed:
        return "no model. prefix", (
            f"{', '.join(repr(p) for p in unprefixed)} name{'s' if len(unprefixed) == 1 else ''}"
            " no module: Phi's embedding and layers sit under `model.` (print(model) shows "
            "model.layers.0.self_attn.q_proj; only lm_head is at the top), so write "
            f"{'model.' + unprefixed[0]!r}. Nothing ran: no step was trained or compared.")
    fused = sorted({p.rsplit(".", 1)[-1] for p in plan if p.rsplit(".", 1)[-1] in FUSED_ELSEWHERE
                    and not any(_matches(p, n) for n in modules)})
    if fused:
        return "fused names", (
            f"{', '.join(fused)} {'is' if len(fused) == 1 else 'are'} fused projections of "
            "other families (Phi-3's qkv_proj and gate_up_proj, GPT-2's c_attn, GPT-NeoX's "
            "query_key_value), which labkit splits part by part; Phi has none: it keeps "
            "q_proj, k_proj and v_proj apart, and its MLP is fc1 then fc2: plan those.")
    for pattern, style in plan.items():
        hits = [n for n in modules if n and _matches(pattern, n)]
        kinds = {type(modules[n]).__name__ for n in hits}
        if any(k.endswith("Attention") for k in kinds):
            return "attention as fused", (
                f"{pattern!r} names the whole attention ({', '.join(sorted(kinds))}), as if "
                "it were one fused projection: Phi keeps q_proj, k_proj, v_proj and dense "
                "apart, and a plan splits layers (nn.Linear), so plan each of them.")
    planned, leaves = _planned(model, plan), _layers(model)
    swapped = sorted({leaves[n] for n, s in planned.items()
                      if (leaves[n] in COLWISE and s == "rowwise")
                      or (leaves[n] in ROWWISE and s == "colwise")})
    if swapped:
        return "swapped", (
            f"column and row swapped: {', '.join(swapped)} planned the other way round. The "
            "first layer of a pair (q_proj, k_proj, v_proj; fc1) is colwise: each rank "
            "computes some heads or features from the whole input; the second (dense; fc2) "
            "is rowwise: it takes those slices and one all-reduce sums the partial outputs.")
    vocab_misused = sorted({leaves[n] for n, s in planned.items()
                            if s == "vocab" and leaves[n] not in VOCAB_LAYERS})
    if vocab_misused:
        return "vocab", (f"{', '.join(vocab_misused)} planned 'vocab': only the embedding "
                         "and lm_head have a vocabulary to split; the others are colwise "
                         "or rowwise.")
    head = {s for n, s in planned.items() if leaves[n] == "lm_head"}
    if "rowwise" in head:
        return "head rowwise", (
            "lm_head planned 'rowwise': a rowwise layer takes its input already split by "
            "features (the output of its colwise partner, as dense takes the attention's "
            "heads), but lm_head's input is the final layer norm's whole hidden state and it "
            "has no partner, so its input does not match its split weight. Split it by "
            "vocabulary: 'vocab' (each rank the logits of its share of the vocabulary, then "
            "gathered for the loss).")
    if "colwise" in head:
        return "head colwise", (
            "lm_head planned 'colwise' (Megatron's own choice) leaves the logits split: each "
            "rank holds the logits of its half of the vocabulary, but the model's loss "
            "(cross-entropy over the whole vocabulary) needs the gathered logits. Megatron "
            "pairs its colwise head with a vocab-parallel cross-entropy, which an HF model's "
            "loss is not: plan lm_head 'vocab', which gathers the logits for the loss.")
    missed = sorted({leaves[n] for n in leaves if n not in planned
                     and leaves[n] in COLWISE + ROWWISE})
    if missed:
        broken = sorted({m for m in missed if any(
            leaves[n] in (PAIRS.get(m), *[a for a, b in PAIRS.items() if b == m])
            for n in planned)})
        stay = "stays" if len(broken) == 1 else "stay"
        what = (f"so its pair is broken: {', '.join(broken)} {stay} whole while the partner "
                "is split, and the shapes or the sums no longer match" if broken else
                "left whole on every rank: right numbers, but its weights are not "
                "split and no memory is saved")
        verb = "is" if len(missed) == 1 else "are"
        return "missed", (f"a layer missed: {', '.join(missed)} {verb} in no entry of the "
                          f"plan, {what}.")
    return None


def _ran(result):
    if result.get("stage") == "refused":
        return f"labkit refused it before any step ran: {result['error']}"
    if "error" in result:
        return f"On 2 ranks it raised {result['error']}"
    if not result["ok"]:
        return (f"On 2 ranks it differs from one device: loss {result['loss']}; parameters "
                f"{result['params']}")
    return "On 2 ranks it equals one device"


def _judge(model, plan, result):
    refusal = result["error"].removeprefix("ValueError: ") \
        if result.get("stage") == "refused" else None
    found = _read_plan(model, plan)
    if refusal is not None:      # labkit refused it in parallelize_module: nothing ran
        if found:
            return Check(False, found[0], f"Not yet: {found[1]} (labkit refuses: {refusal})")
        return Check(False, "refused", f"labkit refuses the plan: {refusal}")
    if found:
        return Check(False, found[0], f"Not yet: {found[1]} {_ran(result).rstrip('.')}.")
    if not result.get("ok"):
        return Check(False, "wrong", f"{_ran(result)}, and the plan reads right to the lab: "
                     "compare each style with print(model).")
    unsplit = [name for name in ("embed_tokens", "lm_head")
               if name not in {n.rsplit(".", 1)[-1] for n in _planned(model, plan)}]
    share = result["bytes"] / result["whole"]
    note = (f" ({', '.join(unsplit)} whole: planned 'vocab' they would split too)"
            if unsplit else "")
    return Check(True, "", f"Correct: {_ran(result)} (loss {result['loss']}; parameters "
                 f"{result['params']}). Each rank holds {result['bytes']:,} bytes of "
                 f"parameters, {share:.0%} of the model's {result['whole']:,}{note}.")


def check_plans(plans, world_size=2, verbose=True):
    """Every plan of `plans` judged (one launch for all): a list of Checks."""
    from ..runtime.launch import LaunchError, launch
    model = build_phi()
    checks, to_run = [None] * len(plans), []
    for i, plan in enumerate(plans):
        if plan is None or plan is Ellipsis:
            checks[i] = Check(False, "no answer", "No answer yet: write plan = {module name "
                              "glob: style} for Phi. Hint: " + HINTS.concept)
        elif not isinstance(plan, dict) or not plan or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
            shown = repr(plan) if len(repr(plan)) <= 40 else repr(plan)[:37] + "..."
            checks[i] = Check(False, "not a plan", "Give a non-empty dict {module name glob: "
                              f"'colwise' | 'rowwise' | 'vocab'}}, not {shown}.")
        else:
            to_run.append(i)
    if to_run:
        try:
            results = launch(_run_plans, world_size, [plans[i] for i in to_run],
                             timeout_s=120)[0]
        except LaunchError as error:
            busy = not_started(str(error))
            message = busy or ("The plan did not finish on every rank: "
                               + str(error).splitlines()[0])
            for i in to_run:
                checks[i] = Check(False, "slow" if busy else "hang", message)
            results = None
        for i, result in zip(to_run, results or ()):
            checks[i] = with_hint(_judge(model, plans[i], result), HINTS)
    for check in checks:
        say(check, verbose)
    return checks


def check_own_plan(plan, world_size=2, verbose=True):
    """Run the learner's Phi plan on `world_size` ranks against one device; print what is
    right or wrong and return a Check."""
    return check_plans([plan], world_size, verbose)[0]
