"""labkit.parallelize (tensor parallelism) on models it was not written for: an nn.Sequential MLP
with a frozen bias, a language model with tied embedding/output weights and a parameter on its
root, labkit's GPT with and without sequence parallelism; SGD and AdamW; 2 and 4 ranks; under
launch, in a plain mp.spawn program, and inside the sub-group {1,3} of 4. Each rank trains the
single-device model beside the split one and compares the gathered parameters after 3 steps.
Then the driver (run tp: comm and memory against theory/), generation with a KV cache, the
one-line errors and the exercise's checker."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit.exercises import tensor_parallel as exercise
from labkit import models, numerics
from labkit.parallel import tensor_parallel as tp
from labkit.runs import reference
from labkit.runs import tensor_parallel as run_tp
from labkit.theory import tensor_parallel as theory_tp
from spawn_helpers import spawn

STEPS = 3


class TiedLM(nn.Module):
    """Embedding and output layer share one weight; a scale parameter sits on the root."""

    def __init__(self, vocab=32, hidden=16):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.emb = nn.Embedding(vocab, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, targets):
        x = self.emb(ids) * self.scale
        x = x + self.fc2(F.gelu(self.fc1(x)))
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mlp():
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    net[0].bias.requires_grad_(False)   # a frozen bias (colwise: its shard stays frozen)
    return net


def _mse(m, step):
    x, y = numerics.cast(_data(step), numerics.dtype_of(m))   # float64 for the exact copy
    return F.mse_loss(m(x), y)


MODELS = {  # name -> (build, plan(sp), loss(model, step))
    "mlp": (mlp, lambda sp: {"0": "colwise", "2": "rowwise"}, _mse),
    "tied": (TiedLM, lambda sp: {"emb": "vocab", "fc1": "colwise", "fc2": "rowwise",
                                 "head": "vocab"},
             lambda m, step: m(*_tokens(step, 32, 12))),
    "gpt": (lambda: models.TinyGPT(), run_tp.gpt_plan,
            lambda m, step: m(*_tokens(step, 128, 32))),
}


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)


def _tokens(step, vocab, seq):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (4, seq), generator=g), torch.randint(0, vocab, (4, seq),
                                                                          generator=g)


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, foreach=False)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6, weight_decay=0.01, foreach=False)


def train_case(model_name, opt, sp, group=None):
    """The single-device model (float32 and float64) and the split one, 3 steps each; how far
    each float32 run is from the float64 one (labkit.numerics)."""
    build, plan, loss_fn = MODELS[model_name]
    ctx = labkit.context()
    ctx.comm.reset()    # this case's collectives only
    torch.manual_seed(0)
    ref = build()
    exact = numerics.exact_copy(ref)
    torch.manual_seed(0)
    split = tp.parallelize(build(), plan(sp), group, sequence_parallel=sp)
    frozen_before = [p.detach().clone() for p in split.parameters() if not p.requires_grad]
    runs = (ref, exact, split)
    opts = [_optimizer(opt, m.parameters()) for m in runs]
    losses = [[], [], []]
    for step in range(STEPS):
        for m, o, curve in zip(runs, opts, losses):
            o.zero_grad(set_to_none=True)
            loss = loss_fn(m, step)
            loss.backward()
            o.step()
            curve.append(loss.item())
    with ctx.off_the_record():
        full = tp.gather_params(split)
        spread = 0.0   # replicated parameters must stay identical on every rank of the group
        for p in split.parameters():
            if p.tp_split is None:
                every = ctx.comm.all_gather(p.detach().reshape(1, -1), group=p.tp_group)
                spread = max(spread, (every - every[:1]).abs().max().item())
    frozen_after = [p for p in split.parameters() if not p.requires_grad]
    return dict(loss=numerics.compare_loss(losses[2], losses[0], losses[1]), spread=spread,
                params=numerics.compare(full, dict(ref.named_parameters()),
                                        dict(exact.named_parameters())),
                frozen_kept=all(torch.equal(a, b) for a, b in zip(frozen_before, frozen_after)),
                tied=getattr(split, "head", None) is not None and model_name == "tied"
                and split.head.weight is split.emb.weight,
                groups={row["group"] for row in ctx.comm.summary()})


def assert_matches(result, model_name, opt):
    # Within rounding of the float64 run (labkit.numerics): a few times float32's own error.
    # AdamW too: the GPT's key bias has a true gradient of 0, and AdamW turns its rounding
    # noise into steps (up to ~lr*1e-4 with eps=1e-6) in the float32 reference as well.
    assert result["loss"], (model_name, opt, str(result["loss"]))
    assert result["params"], (model_name, opt, str(result["params"]))
    assert result["spread"] == 0.0
    assert result["frozen_kept"]


CASES_2 = [("mlp", "sgd", False), ("mlp", "adamw", False), ("tied", "sgd", False),
           ("tied", "adamw", False), ("gpt", "sgd", False), ("gpt", "adamw", True)]
CASES_4 = [("mlp", "adamw", False), ("tied", "sgd", False), ("gpt", "sgd", True),
           ("gpt", "adamw", False)]
CASES_SUBGROUP = [("gpt", "sgd", True), ("mlp", "adamw", False)]


def on_two_ranks(ctx):
    out = {case: train_case(*case) for case in CASES_2}
    out["errors"] = bad_plans()
    out["torch spelling"] = {sp: torch_spelling_against_strings(sp) for sp in (False, True)}
    cfg = reference.RunConfig()
    model = run_tp.build_tp_model(cfg)
    out["generate"] = run_tp.generate(ctx, model, _tokens(0, 128, 6)[0][:2], 8)
    return out


def gpt_plan_in_torch_styles(sequence_parallel):
    """gpt_plan's strings in torch's styles: "vocab" on the embedding is
    RowwiseParallel(input_layouts=Replicate()), on the head ColwiseParallel(output_layouts=
    Replicate()); with SP the norms are SequenceParallel and Shard(-2) is the sequence."""
    from labkit.parallel import (ColwiseParallel, Replicate, RowwiseParallel,
                                 SequenceParallel, Shard)
    seq = Shard(-2) if sequence_parallel else Replicate()
    plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "blocks.*.attn.qkv": ColwiseParallel(input_layouts=seq),
            "blocks.*.attn.proj": RowwiseParallel(output_layouts=seq),
            "blocks.*.mlp.fc1": ColwiseParallel(input_layouts=seq),
            "blocks.*.mlp.fc2": RowwiseParallel(output_layouts=seq),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sequence_parallel:
        plan.update({"pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
                     "blocks.*.ln1": SequenceParallel(), "blocks.*.ln2": SequenceParallel(),
                     "ln_f": SequenceParallel()})
    return plan


def torch_spelling_against_strings(sequence_parallel):
    """labkit's GPT split by parallelize_module in torch's styles and by the old string plan:
    the same layers and collectives, so the same losses and parameters, bit for bit."""
    from labkit.parallel import parallelize_module
    from labkit.parallel.tensor_parallel_plan import gpt_plan
    runs = []
    for split in (lambda m: tp.parallelize(m, gpt_plan(sequence_parallel), None,
                                           sequence_parallel),
                  lambda m: parallelize_module(m, None,
                                               gpt_plan_in_torch_styles(sequence_parallel))):
        torch.manual_seed(0)
        model = split(models.TinyGPT(models.GPTConfig(layers=2, hidden=32, heads=4, seq=8,
                                                      vocab=64, ffn=64)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            ids, targets = _tokens(step, 64, 8)
            loss = model(ids, targets)   # with SP too: the head gathers the whole sequence
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append((losses, tp.gather_params(model)))
    return runs


def bad_plans():
    """The one-line errors, raised before any weight is touched."""
    messages = []
    for build, plan in [(models.TinyGPT, {"blocks.*.attn.qkv": "colwise", "nope.*": "rowwise"}),
                        (models.TinyGPT, {"blocks.*.ln1": "colwise"}),
                        (models.TinyGPT, {"tok": "rowwise"}),
                        (models.TinyGPT, {"head": "sideways"}),
                        (lambda: models.TinyGPT(models.GPTConfig(heads=3, hidden=48)),
                         {"blocks.*.attn.qkv": "colwise"}),
                        (lambda: models.TinyGPT(models.GPTConfig(vocab=127)), {"tok": "vocab"}),
                        (lambda: models.TinyGPT(models.GPTConfig(ffn=255)),
                         {"blocks.*.mlp.fc1": "colwise"})]:
        model = build()
        before = {n: type(m) for n, m in model.named_modules()}
        try:
            tp.parallelize(model, plan)
            messages.append(None)
        except ValueError as error:
            untouched = before == {n: type(m) for n, m in model.named_modules()}
            messages.append((str(error), untouched))
    return messages


def on_four_ranks(ctx):
    out = {case: train_case(*case) for case in CASES_4}
    pair = ctx.split_groups([[0, 2], [1, 3]])     # TP inside {0,2} and {1,3}, side by side
    out["subgroup"] = {case: train_case(*case, group=pair) for case in CASES_SUBGROUP}
    return out


def in_spawned_program(rank, world_size):
    return {case: train_case(*case) for case in [("gpt", "sgd", True), ("tied", "adamw", False)]}


@pytest.fixture(scope="module")
def two():
    return labkit.launch(on_two_ranks, 2, timeout_s=300)


@pytest.mark.numerics
@pytest.mark.parametrize("case", CASES_2, ids=lambda c: "-".join(map(str, c)))
def test_two_ranks_equal_one_device(two, case):
    for rank in two:
        assert_matches(rank[case], *case[:2])
    if case[0] == "tied":
        assert two[0][case]["tied"]          # one shard serves both the embedding and the head


def test_four_ranks_and_the_subgroup_1_3_of_4():
    results = labkit.launch(on_four_ranks, 4, timeout_s=300)
    for rank in results:
        for case in CASES_4:
            assert_matches(rank[case], *case[:2])
        for case in CASES_SUBGROUP:
            assert_matches(rank["subgroup"][case], *case[:2])
    assert results[1]["subgroup"][CASES_SUBGROUP[0]]["groups"] == {"1,3"}
    assert results[0]["subgroup"][CASES_SUBGROUP[0]]["groups"] == {"0,2"}


@pytest.mark.numerics
def test_a_plain_spawn_program_without_launch():
    for rank in spawn(in_spawned_program, 2):
        for case, result in rank.items():
            assert_matches(result, *case[:2])


def test_torch_styles_split_labkit_gpt_as_the_string_plan_does(two):
    for rank in two:
        for sequence_parallel, (strings, styles) in rank["torch spelling"].items():
            assert strings[0] == styles[0], sequence_parallel   # losses
            for name, value in strings[1].items():
                assert torch.equal(value, styles[1][name]), (sequence_parallel, name)
            assert strings[0][0] != strings[0][-1]   # it trained


def test_bad_plans_fail_in_one_line_before_anything_changes(two):
    messages = two[0]["errors"]
    assert all(m is not None and m[1] and "\n" not in m[0] for m in messages)
    text = [m[0] for m in messages]
    assert "'nope.*' matches no module" in text[0]
    assert "'colwise' applies to nn.Linear; blocks.0.ln1 is of type LayerNorm" in text[1]
    assert "tok is of type Embedding" in text[2] and "style must be one of" in text[3]
    assert "TP degree 2 does not divide heads=3 of blocks.0.attn" in text[4]
    assert "does not divide the 127 rows (vocabulary) of tok" in text[5]
    assert "does not divide the 255 output features of blocks.0.mlp.fc1" in text[6]


def test_greedy_generation_with_a_kv_cache_equals_the_reference(two):
    tokens, cache_bytes = two[0]["generate"]
    prompt = _tokens(0, 128, 6)[0][:2]
    expected = run_tp.reference_generate(reference.build_model(reference.RunConfig()), prompt, 8)
    assert torch.equal(tokens, expected) and torch.equal(two[1]["generate"][0], expected)
    c = models.GPTConfig()  # k and v of this rank's heads for 6 + 7 positions, fp32
    assert cache_bytes == 2 * c.layers * 2 * (6 + 7) * c.hidden // 2 * 4


# ------------------------------------------------------------------------------- the driver

SGD = reference.RunConfig(steps=2, optimizer="sgd")


def _last_step_logits_and_grads(cfg, dtype):
    """One device in `dtype`: the last step's logits and gradients, before its update."""
    model = reference.build_model(cfg).to(dtype)
    opt = reference.build_optimizer(model.parameters(), cfg)
    for step in range(cfg.steps):
        x, y = reference.batch(model, cfg, step, dtype)
        opt.zero_grad()
        model(x, y).backward()
        if step < cfg.steps - 1:
            opt.step()
    return model(x).detach(), {n: p.grad for n, p in model.named_parameters()}


def test_the_driver_matches_one_device_and_theory():
    report = run_tp.report(2, SGD, details=True)
    for key in ("params", "loss"):   # labkit.numerics against the float64 run
        assert report["agreement"][key]["ok"], report["agreement"][key]["verdict"]
    (logits, grads), (logits64, grads64) = (_last_step_logits_and_grads(SGD, dtype)
                                            for dtype in (torch.float32, torch.float64))
    verdict = numerics.compare(report["logits"], logits, logits64)
    assert verdict, str(verdict)
    verdict = numerics.compare(report["grads"], grads, grads64)
    assert verdict, str(verdict)
    _check_comm_and_memory(report, SGD, 2, sequence_parallel=False)


def test_cli_with_sequence_parallel_and_shape_flags(capsys):
    from labkit import cli
    cli.main(["run", "tp", "--world-size", "2", "--sequence-parallel", "--heads", "8",
              "--hidden", "64", "--steps", "2", "--optimizer", "sgd", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["technique"] == "tp" and report["config"]["sequence_parallel"] is True
    assert report["config"]["model_kwargs"] == dict(heads=8, hidden=64)
    assert report["agreement"]["params"]["ok"], report["agreement"]["params"]["verdict"]
    cfg = reference.RunConfig(steps=2, optimizer="sgd", model_kwargs=dict(heads=8, hidden=64))
    report["memory"] = {int(k): v for k, v in report["memory"].items()}
    _check_comm_and_memory(report, cfg, 2, sequence_parallel=True)


def _check_comm_and_memory(report, cfg, n, sequence_parallel):
    c = run_tp.gpt_config(cfg)
    block = {}   # one block's collectives per step, from the log's per-tag totals
    for row in report["comm_by_tag"]:
        if row["tag"].startswith("blocks.0."):
            key = ("backward" if " bwd" in row["tag"] else "forward", row["op"])
            calls, size = block.get(key, (0, set()))
            block[key] = (calls + row["calls"], size | {row["bytes"] // row["calls"]})
    predicted = theory_tp.block_comm(cfg.global_batch, c.seq, c.hidden, n,
                                     sequence_parallel=sequence_parallel, bytes_per_element=4)
    assert block == {(r["direction"], r["op"]): (r["calls"] * cfg.steps, {r["bytes"]})
                     for r in predicted}
    want = report["predicted_comm"]
    assert {r["op"]: (r["calls"], r["bytes"]) for r in report["comm"]} == \
        {op: (w["calls"], w["bytes"]) for op, w in want.items()}
    assert sum(r["wire_bytes_per_rank"] for r in report["comm"]) == \
        pytest.approx(report["predicted_comm_bytes_per_rank"])
    mem, pred = report["memory"][0], theory_tp.tiny_gpt_training_memory(
        **c.as_dict(), batch=cfg.global_batch, tp=n, sequence_parallel=sequence_parallel,
        optimizer=cfg.optimizer)
    assert mem["params"] == mem["grads"] == pred["params"]
    assert mem["activations"] == pytest.approx(pred["activations"], rel=0.15)


@pytest.mark.parametrize("overrides,sp,word", [
    (dict(heads=4, hidden=64, vocab=129), False, "heads=4 of blocks.0.attn"),
    (dict(ffn=90), False, "90 output features of blocks.0.mlp.fc1"),
    (dict(vocab=130), False, "130 rows .vocabulary. of tok"),
    (dict(seq=30), True, "30 rows .vocabulary. of pos"),
])
def test_a_tp_degree_that_does_not_divide_fails_before_any_rank_starts(overrides, sp, word):
    cfg = reference.RunConfig(model_kwargs=overrides)
    n = 3 if "heads" in overrides else 4
    with pytest.raises(ValueError, match=word):
        run_tp.report(n, cfg, sequence_parallel=sp)
    with pytest.raises(ValueError, match="--model gpt"):
        run_tp.check_tp_degree(reference.RunConfig(model="mlp"), 2)


def test_the_exercise_checker_says_what_is_wrong():
    def no_all_reduce(ctx, x, w, bias, group):
        return F.linear(x, w, bias)

    def bias_before(ctx, x, w, bias, group):
        return ctx.comm.all_reduce(F.linear(x, w, bias), group=group)

    checks = [exercise.check_row_parallel(f, verbose=False)
              for f in (no_all_reduce, bias_before, exercise.row_parallel_forward)]
    assert [c.problem for c in checks] == ["no sum", "bias", ""]
    assert "counted 2 times" in checks[1].message and checks[2].ok
    assert "all_reduce" in checks[2].message


# ------------------------------------------------------------------------- theory and widget

def test_modelled_step_time_and_inference_memory_for_llama_3_70b():
    from labkit import theory
    table = theory_tp.step_time_table("llama-3-70b", (1, 2, 4, 8, 16), batch=1, seq=4096)
    assert list(table["link"]) == ["NVLink 4"] * 4 + ["InfiniBand NDR"]
    assert table.loc[8, "total"] < table.loc[1, "total"] / 4          # NVLink: faster
    assert table.loc[16, "total"] > table.loc[8, "total"]             # IB: slower than 8
    assert table["exposed_share"].is_monotonic_increasing
    inf = theory_tp.inference_table("llama-3-70b", (2, 4, 8), ("bf16", "int4"),
                                    batch=8, context=8192)
    bf16_tp2 = inf[(inf.tp == 2) & (inf.weights == "bf16")].iloc[0]
    params = theory.model("llama-3-70b").param_count()
    assert bf16_tp2.weights_gb == pytest.approx(params * 2 / 2 / 1e9)
    # KV cache: 2 (k, v) x 80 layers x 8 kv heads x 128 x 8192 x 8 x 2 bytes, split over 2
    assert bf16_tp2.kv_cache_gb == pytest.approx(2 * 80 * 8 * 128 * 8192 * 8 * 2 / 2 / 1e9)


def test_the_widget_panels_say_which_link():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from labkit.viz import tp_widgets
    fig = plt.figure(figsize=(14, 4.4))
    tp_widgets.tp_panels(fig, tp=2)
    summary = tp_widgets.tp_panels(fig, model="Llama 3 70B", tp=16, sequence_parallel=True,
                                   link="NVLink 4", batch=2, seq=8192)
    fig.canvas.draw()
    assert "TP=16 + SP over InfiniBand NDR" in summary and len(fig.axes) == 3
    labels = [t for t in fig.axes[0].get_xticklabels() if t.get_text()]
    boxes = [t.get_window_extent() for t in labels]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    plt.close(fig)
