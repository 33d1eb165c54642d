# ---
# jupyter:
#   jupytext:
#     formats: ipynb,src//py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · Your own model: a Hugging Face model through every block
#
# Lessons 01-10 used labkit's own TinyGPT. The model you will train or serve is more likely a
# Hugging Face `transformers` model: Llama, Qwen, Mistral, GPT-2, Mixtral... This lesson takes
# three of them and applies each technique **with the same calls as on TinyGPT**: no rewrite,
# no glue. Every run is checked the lab's way: against the same model on one device
# (`labkit.numerics`: float32 and float64 single-device runs; the parallel run passes when its
# error is within a few times float32's own), and, where PyTorch has its own version of the
# block, against it.
#
# The models are built **from configs**, with random weights: nothing is downloaded, ever.
# A pretrained checkpoint would change the numbers, not the code: `from_pretrained` builds the
# same modules. Three families cover what differs between models:
# - **Llama** with grouped-query attention (GQA: 4 query heads share 2 key/value heads), the
#   layout of Llama 2/3, Mistral, Qwen2/3 (separate `q_proj`, `k_proj`, `v_proj`);
# - **GPT-2**: `Conv1D` layers (a Linear whose weight is stored transposed) and one fused
#   `c_attn` holding q|k|v, which a tensor-parallel split must cut part by part;
# - **Mixtral**: a mixture of experts in every layer, its experts stacked in one 3-D tensor.
#
# What a block cannot do right it **refuses in one line** that names the module and why
# (section 5). Needs the `hf` extra: `pip install -e ".[hf]"`.

# %%
import time

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import labkit
from labkit import numerics
from labkit.exercises.your_own_model import build_phi, check_own_plan, show_solution
from labkit.parallel import serving, tensor_parallel as tp
from labkit.parallel.context_parallelism import ContextParallel, context_parallel_batch
from labkit.parallel.data_parallel import DistributedDataParallel
from labkit.parallel.flat import average_gradients
from labkit.parallel.fully_shard import FullyShard
from labkit.parallel.hf_experts import stack_experts
from labkit.parallel.moe import ExpertParallel, average_moe_gradients, full_parameters
from labkit.parallel.parallel_styles import parallelize_module
from labkit.parallel.pipeline import PipelineStage, Schedule1F1B, split_into_stages
from labkit.parallel.self_check import SelfCheckError
from labkit.parallel.tp_presets import tp_plan_for
from labkit.theory.hf_shape import hf_shape
from labkit.viz import plots
from labkit.viz.own_model_widgets import own_model_explorer

pd.set_option("display.precision", 3)
pd.set_option("display.max_colwidth", None)   # verdicts are sentences: show them whole
torch.set_num_threads(1)   # tiny models on 2 shared cores: one thread each beats two

# %% [markdown]
# ## 1 · Three models from configs
#
# `build(family)` makes a 2-layer model of each family, seeded, in float32 (or float64 for the
# exact reference). Dropout is 0 in every config: a dropout mask is random, and no two runs
# would agree.

# %%
VOCAB = 128
NO_TOKENS = dict(bos_token_id=0, eos_token_id=None, pad_token_id=0)   # generate runs full length


def build(family, dtype=torch.float32, seed=0, experts="eager"):
    t = transformers
    small = dict(vocab_size=VOCAB, num_hidden_layers=2, **NO_TOKENS)
    llama_like = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, **small)
    config = {
        "llama": lambda: t.LlamaConfig(**llama_like),
        "gpt2": lambda: t.GPT2Config(n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, **small),
        "mixtral": lambda: t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                           experts_implementation=experts,
                                           **dict(llama_like, intermediate_size=48)),
        "qwen3": lambda: t.Qwen3Config(head_dim=8, **llama_like),   # + per-head q/k norms
    }[family]()
    torch.manual_seed(seed)
    return t.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)


def tokens(step, batch=4, length=16):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(step))


pd.DataFrame({f: {"class": type(m).__name__, "parameters": sum(p.numel() for p in m.parameters()),
                  "layers named like": next(n for n, _ in m.named_modules() if n.endswith("0"))}
              for f, m in ((f, build(f)) for f in ("llama", "gpt2", "mixtral"))}).T

# %% [markdown]
# Tensor parallelism needs to know which layer is split which way. For the families it knows,
# labkit keeps a **preset plan as data**, the same `{module name glob: style}` dict as PyTorch's
# `parallelize_module` and transformers' own `base_model_tp_plan`: read it, change it, pass it.

# %%
tp_plan_for(build("llama"))

# %% [markdown]
# ## 2 · Training: each block against one device and against PyTorch's own
#
# On 2 ranks, each block trains the Llama 2 AdamW steps: `DistributedDataParallel` and `FullyShard`
# with half the batch per rank (their gradients averaged), `parallelize_module` with the whole batch
# (each rank half of every layer). Beside each, PyTorch's own: `DistributedDataParallel`,
# `fully_shard` (FSDP2) and `parallelize_module` (DTensor; the vocabulary entries left out, it has
# no vocab-parallel loss for an HF head). After the steps every rank gathers the full parameters,
# and we read what each rank holds (weights, gradients and AdamW's two moments, measured from the
# tensors) and what labkit's comm log saw (ring-model bytes per rank, modelled; torch's sides do not
# go through labkit's log).

# %%
def train(model, batch_for, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, foreach=False)
    for step in range(steps):
        ids = batch_for(step)
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids)["loss"].backward()
        opt.step()
    return opt


def held_bytes(opt):
    """Bytes of the weights, gradients and optimizer state this rank holds: its own shards
    (a DTensor's local part: `to_local()`)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    state = [s for st in opt.state.values() for s in st.values()
             if torch.is_tensor(s) and s.dim()]
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes
               for t in params + grads + state)


def is_layer(m):
    return type(m).__name__ == "LlamaDecoderLayer"


def six_ways(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize
    half = lambda step: tokens(step)[ctx.rank * 2:(ctx.rank + 1) * 2]   # noqa: E731
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    out = {}
    for side in ("DistributedDataParallel", "torch DDP", "FullyShard", "fully_shard",
                 "parallelize_module", "torch parallelize_module"):
        model, batch_for = build("llama"), half
        if side == "DistributedDataParallel":   # buffers (RoPE's) broadcast once, when built
            wrapped = DistributedDataParallel(model, forward_sync_buffers=False)
        elif side == "torch DDP":
            wrapped = nn.parallel.DistributedDataParallel(model)
        elif side == "FullyShard":
            wrapped = FullyShard(model, units=lambda m: m is model or is_layer(m))
        elif side == "fully_shard":
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        elif side == "parallelize_module":
            wrapped, batch_for = parallelize_module(model, None), tokens   # the llama preset
        else:
            plan = {k: v for k, v in tp_plan_for(model).items() if v != "vocab"}
            wrapped, batch_for = torch_parallelize(
                model, mesh, {k: styles[v]() for k, v in plan.items()}), tokens
        ctx.comm.reset()
        opt = train(wrapped, batch_for)
        sent, calls = ctx.comm.wire_bytes(), ctx.comm.summary(by=("op", "tag"))
        with ctx.off_the_record():
            if side == "FullyShard":
                params = wrapped.full_state_dict()
            elif side == "parallelize_module":
                params = tp.gather_params(model)
            else:
                params = {n: getattr(p, "full_tensor", p.detach)().detach()
                          for n, p in model.named_parameters()}
        out[side] = dict(params=params, held=held_bytes(opt), sent=sent, calls=calls)
    return out


ranks = labkit.launch(six_ways, 2)

# %%
names = [n for n, _ in build("llama").named_parameters()]
single, exact = build("llama"), build("llama", torch.float64)
train(single, tokens), train(exact, tokens)
one = {n: p.detach() for n, p in single.named_parameters()}
ref = {n: p.detach() for n, p in exact.named_parameters()}
one_bytes = 4 * sum(p.nbytes for p in single.parameters())   # weights, grads, 2 AdamW moments
rows = {}
for mine, theirs in (("DistributedDataParallel", "torch DDP"), ("FullyShard", "fully_shard"),
                     ("parallelize_module", "torch parallelize_module")):
    for side in (mine, theirs):
        r = ranks[0][side]
        got = {n: r["params"][n] for n in names}
        rows[side] = {
            "vs one device (numerics)": str(numerics.compare(got, one, ref)),
            "max |labkit - torch|": (max((r["params"][n] - ranks[0][theirs]["params"][n])
                                         .abs().max().item() for n in names)
                                     if side == mine else None),
            "held per rank (B, measured)": r["held"],
            "share of one device": r["held"] / one_bytes,
            "labkit comm log (B/rank, modelled)": r["sent"] if side == mine else None,
        }
pd.DataFrame(rows).T

# %%
layer_calls, other_calls = {}, {}
for row in ranks[0]["parallelize_module"]["calls"]:
    module, _, direction = row["tag"].rpartition(" ")
    if ".layers." in module:                  # model.layers.<i>.<module path>
        key = (row["op"], direction, module.split(".layers.", 1)[1].split(".", 1)[1])
        layer_calls[key] = layer_calls.get(key, 0) + row["calls"]
    else:
        key = (row["op"], direction, module)
        other_calls[key] = other_calls.get(key, 0) + row["calls"]
per = len(single.model.layers) * 2            # layers x the 2 training steps
for direction in ("fwd", "bwd"):
    mine = {k: v for k, v in layer_calls.items() if k[1] == direction}
    print(f"per layer and step, {direction}: {sum(mine.values()) / per:g} collectives: "
          + ", ".join(f"{op} {module} {n / per:g}x" for (op, _, module), n in sorted(mine.items())))
print("per step, outside the layers: " + ", ".join(
    f"{op} {module} ({direction}) {n / 2:g}x" for (op, direction, module), n in
    sorted(other_calls.items())))

# %%
held = {"one device": {"model states": one_bytes}}
held.update({side: {"model states": row["held per rank (B, measured)"]}
             for side, row in rows.items()})
plots.memory_stack(held, unit="KB", title="weights, gradients and AdamW moments held by rank 0 "
                   "(measured), 2 ranks: labkit's block beside PyTorch's");

# %% [markdown]
# Read the table by rows. Each labkit block is within rounding of one device, and so is
# PyTorch's: the same model trained the same way. The column max |labkit - torch| is the
# largest difference of any parameter between labkit's block and PyTorch's after the same
# steps: 0 means bit for bit (the same sums in the same order); a difference of float32's
# rounding (about 1e-7 of the values) would mean the same sums in another order. labkit's
# `parallelize_module` used the whole preset, torch's only the attention and
# MLP entries.
#
# The memory column is the point of the blocks: data parallelism keeps a whole copy on every
# rank (100 %), `FullyShard` about half on 2 ranks (ZeRO-3), tensor parallelism a little over
# half (the RMSNorm weights stay whole; torch's side also keeps the embedding and the head
# whole, as its plan left them out). Bytes sent: data parallelism all-reduces the gradients
# once per step; `FullyShard` gathers the weights in forward and again in backward and
# reduce-scatters the gradients (1.5 times DP's bytes, the ZeRO paper's count, Rajbhandari et
# al. 2020, arXiv 1910.02054);
# `parallelize_module` sends activations: the cell below counts its collectives from rank 0's comm
# log, per layer and step, forward and backward apart (a tag ending in "fwd" or "bwd"). In
# forward each layer sums the partial outputs of its two rowwise layers (the attention's
# o_proj, the MLP's down_proj); in backward every colwise layer sums its input's gradient on its
# own, as many all-reduces as colwise layers (q, k, v, gate and up: HF keeps them apart);
# outside the layers come the vocabulary-split embedding and head.
# `bench/hf_llama.py` times the three pairs on a larger Llama (rows `hf_llama` in
# data/bench.csv).

# %% [markdown]
# ## 3 · Pipeline, experts, long sequences
#
# The other training blocks, each in one line on the HF model:
# - **pipeline**: `split_into_stages(model, 2)` cuts the decoder at a layer boundary (stage 0:
#   embedding + first layers, stage 1: the rest + norm + head; a tied head keeps its copy of
#   the embedding in step), and `PipelineStage` + the 1F1B schedule run it as on TinyGPT;
# - **experts**: `layer.mlp = ExpertParallel(layer.mlp)` puts half of Mixtral's 4 experts on
#   each rank, tokens travel to their experts by all-to-all; each rank has half the batch;
# - **context parallelism**: `ContextParallel(model, layout="zigzag")` routes HF's own
#   `scaled_dot_product_attention` calls through ring attention; `context_parallel_batch`
#   hands each rank its slices of the sequence with their *global* positions and the labels
#   shifted *before* sharding (shifting per shard would lose the token at each cut).

# %%
def loss_on_logits(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def sgd(model, batch_for, steps=2, moe=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        ids = batch_for(step)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        if moe:
            average_moe_gradients(model, None)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def other_blocks(ctx):
    out = {}
    # pipeline: 2 stages, 2 micro-batches, 1F1B; targets are the next tokens
    model = build("llama")
    names = {id(p): n for n, p in model.named_parameters()}
    stage = PipelineStage(split_into_stages(model, 2)[ctx.rank], ctx.rank, 2)
    pipe = Schedule1F1B(stage, n_microbatches=2, loss_fn=loss_on_logits)
    opt = torch.optim.SGD(stage.parameters(), lr=0.5)
    for step in range(2):
        ids = tokens(step)
        opt.zero_grad()
        pipe.step(ids[:, :-1] if stage.is_first else None,
                  target=ids[:, 1:] if stage.is_last else None)
        opt.step()
    out["pipeline"] = {names[id(p)]: p.detach() for p in stage.parameters() if id(p) in names}
    # experts: half the batch per rank, expert gradients stay on their rank
    moe = build("mixtral")
    for layer in moe.model.layers:
        layer.mlp = ExpertParallel(layer.mlp)
    sgd(moe, lambda step: tokens(step)[ctx.rank * 2:(ctx.rank + 1) * 2], moe=True)
    out["experts"] = stack_experts(full_parameters(moe))
    # context parallelism: each rank 8 of the 16 positions (zigzag: two slices of 4)
    ctx.comm.reset()
    cp = ContextParallel(build("llama"), layout="zigzag")
    batch = context_parallel_batch(tokens(0), tokens(0), layout="zigzag")
    loss = batch.loss(cp(**batch.inputs).logits)
    loss.backward()
    average_gradients(cp.parameters(), tag="cp grads")
    out["cp"] = dict(loss=loss.item(), sent=ctx.comm.summary(by=("op",)),
                     grads={n.removeprefix("module."): p.grad for n, p in cp.named_parameters()})
    return out


blocks = labkit.launch(other_blocks, 2)

# %%
def stepped(family, dtype, pipeline=False):
    model = build(family, dtype)
    if pipeline:    # the same loss as the pipeline's: next-token cross-entropy
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(2):
            ids = tokens(step)
            opt.zero_grad()
            loss_on_logits(model(input_ids=ids[:, :-1]).logits, ids[:, 1:]).backward()
            opt.step()
        return {n: p.detach() for n, p in model.named_parameters()}
    return sgd(model, tokens)


pp = {**blocks[0]["pipeline"], **blocks[1]["pipeline"]}
verdicts = {"pipeline (Llama, 2 stages, 1F1B)": numerics.compare(
    {n: pp[n] for n in stepped("llama", torch.float32, pipeline=True)},
    stepped("llama", torch.float32, pipeline=True),
    stepped("llama", torch.float64, pipeline=True))}
moe_one, moe_exact = stepped("mixtral", torch.float32), stepped("mixtral", torch.float64)
verdicts["experts (Mixtral, 2 of 4 experts per rank)"] = numerics.compare(
    {n: blocks[0]["experts"][n] for n in moe_exact}, moe_one, moe_exact)


def one_device_grads(dtype):
    model = build("llama", dtype)
    loss = model(input_ids=tokens(0), labels=tokens(0)).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


(l32, g32), (l64, g64) = one_device_grads(torch.float32), one_device_grads(torch.float64)
cp = blocks[0]["cp"]
verdicts["context parallel (Llama, zigzag ring): loss"] = numerics.compare_loss(
    [cp["loss"]], [l32], [l64])
verdicts["context parallel (Llama, zigzag ring): gradients"] = numerics.compare(
    {n: cp["grads"][n] for n in g64}, g32, g64)
for what, agreement in verdicts.items():
    print(f"{what:50} {agreement}")
print("ring attention's traffic, rank 0 (a send's bytes count at the sender, so recv shows 0):",
      "; ".join(f"{r['op']} {r['calls']}x {r['wire_bytes_per_rank']:,.0f} B (modelled)"
                for r in cp["sent"]))

# %% [markdown]
# ## 4 · Generation with HF's own cache
#
# `serving.cache_for(model)` gives an HF model its own cache (`DynamicCache`); `generate` is
# lesson 09's greedy loop, prefill then one token at a time. Under `parallelize_module` each rank's
# attention holds only its heads, so its cache holds only their keys and values: with GQA,
# 1 of the 2 KV heads per rank. The reference is transformers' own
# `model.generate(do_sample=False)` on one device.

# %%
prompt = tokens(7, batch=2, length=6)


def hf_generate(model, new_tokens=8):
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return out[:, prompt.shape[1]:]


def tp_generate(ctx, family):
    model = parallelize_module(build(family).eval(), None)
    cache = serving.cache_for(model)
    ctx.comm.reset()
    out = serving.generate(model, prompt, 8, cache)
    return out, cache.nbytes(), ctx.comm.summary(by=("op",))


for family in ("llama", "gpt2"):
    whole = build(family).eval()
    cache = serving.cache_for(whole)
    alone = serving.generate(whole, prompt, 8, cache)
    on_ranks = labkit.launch(tp_generate, 2, family)
    print(f"{family}: one device = HF generate: {torch.equal(alone, hf_generate(whole))}; "
          f"TP 2 = HF generate: {all(torch.equal(r[0], hf_generate(whole)) for r in on_ranks)}"
          f"; cache {cache.nbytes():,} B on one device, {on_ranks[0][1]:,} B per rank; "
          + "; ".join(f"{r['op']} {r['calls']}x" for r in on_ranks[0][2]))
forwards, layers = 8, whole.config.num_hidden_layers   # the prefill + 7 decode steps
print(f"expected per rank: {forwards * (2 * layers + 1)} all-reduces ({forwards} forwards x (2 "
      f"per layer x {layers} layers + 1 for the vocab-split embedding)) and {forwards} "
      "all-gathers (the vocab-split head's logits, for the greedy pick)")

# %% [markdown]
# ## 5 · When a block cannot: one line that says why
#
# A model family brings layouts the lab may not know. The refusal comes before any weight is
# touched and names the module: here an attention written like Phi-1's first release, whose
# q|k|v sit in one `Wqkv` of a layout labkit cannot know (q|k|v one after the other? per
# head?). A contiguous split would hand rank 0 all of q and half of k: a silently wrong model.

# %%
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = 4, 8
        self.Wqkv, self.out_proj = nn.Linear(32, 96), nn.Linear(32, 32)


def refused(ctx):
    try:
        parallelize_module(nn.Sequential(Block()), None,
                           {"0.Wqkv": "colwise", "0.out_proj": "rowwise"})
    except ValueError as error:
        return f"ValueError: {error}"


print(labkit.launch(refused, 2)[0])

# %% [markdown]
# ### A plan that runs is not a plan that trains right: the self-check
#
# Worse than a crash is a plan that runs without an error and trains wrong. Qwen3 normalises
# each head's queries and keys with an RMSNorm (`q_norm`, `k_norm`) whose one weight of
# `head_dim` values all the heads share. Split the heads over 2 ranks and keep the norm whole
# on each: the forward is still right, but each rank's gradient of that weight sums over its
# own heads only. Llama's plan says nothing about these norms, so it leaves each rank its
# partial gradient: the ranks' copies drift apart, and from one device, step after step.
# (transformers marks them `replicated_with_grad_allreduce`; labkit's `qwen3` preset says
# `"replicated_grad_sum"`: the gradient is summed over the TP group in backward.)
#
# So `parallelize_module` (with a plan of labkit's strings) checks itself before it touches the
# model (on by default for a Hugging Face model): it builds a miniature of the same class from the
# model's own config (2 layers, a few heads), applies the same plan on the same ranks, runs one
# forward and backward on random tokens against the unsplit miniature, and refuses in one line,
# naming where it first goes wrong, if the output or any gradient differs beyond `labkit.numerics`'
# rule. Below: the preset minus its two norm entries (the `qwen3` plan before the fix), then the
# preset itself, timed with the check and without it (`verify=False`). The last lines show the
# refusal was true: the same wrong plan with the check skipped, one step's gradients against one
# device.

# %%
def one_step_grads(model):
    model(input_ids=tokens(0), labels=tokens(0)).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def qwen3_plans(ctx):
    right = tp_plan_for(build("qwen3"))                                    # labkit's preset
    wrong = {k: v for k, v in right.items() if v != "replicated_grad_sum"}   # before the fix
    out = {"left out": sorted(set(right) - set(wrong))}
    try:
        parallelize_module(build("qwen3"), None, wrong)   # the self-check is on: refused here
    except SelfCheckError as error:
        out["refusal"] = f"{type(error).__name__}: {error}"
    for verify in (True, False):
        model = build("qwen3")
        start = time.perf_counter()
        parallelize_module(model, None, right, verify=verify)
        out[f"seconds, verify={verify}"] = time.perf_counter() - start
    one_step_grads(model)                               # the preset, split without the check
    unchecked = parallelize_module(build("qwen3"), None, wrong, verify=False)
    one_step_grads(unchecked)
    with ctx.off_the_record():
        out["grads"] = {"preset": tp.gather_grads(model), "wrong": tp.gather_grads(unchecked)}
    return out


checked = labkit.launch(qwen3_plans, 2)
print("the plan without:", ", ".join(checked[0]["left out"]))
print(checked[0]["refusal"])
for rank, result in enumerate(checked):
    cost = result["seconds, verify=True"] - result["seconds, verify=False"]
    print(f"rank {rank}: the preset passes: parallelize_module took "
          f"{result['seconds, verify=True']:.2f} s with the check, "
          f"{result['seconds, verify=False']:.2f} s with verify=False: the "
          f"check costs {cost:.2f} s (measured)")
g32 = one_step_grads(build("qwen3"))
g64 = one_step_grads(build("qwen3", torch.float64))
q_norm = "model.layers.1.self_attn.q_norm.weight"
pd.DataFrame({f"{plan}, rank {rank}": {
    "all gradients vs one device": str(numerics.compare(
        {n: result["grads"][plan][n] for n in g64}, g32, g64)),
    f"{q_norm} vs one device": str(numerics.compare(
        result["grads"][plan][q_norm], g32[q_norm], g64[q_norm]))}
    for plan in ("preset", "wrong") for rank, result in enumerate(checked)}).T

# %% [markdown]
# Takeaway: a plan is right when a run with it equals one device, not when it runs. The check
# costs one forward and backward of a miniature, before the first step, printed above; the
# wrong plan never reaches a step, and the refusal names the parameter where the wrong
# gradient enters. `verify=False` skips it (the exercise's checker below does: it compares whole
# training runs with one device itself). With the check skipped, the table shows what the
# refusal saved: the norm's gradient off on both ranks, and by different amounts.

# %% [markdown]
# Other refusals you may meet: a TP degree that does not divide the KV heads (4 ranks on the
# Llama above: 2 KV heads), sequence parallelism on an HF model (its positions and mask come
# from the sequence length it is handed), `ContextParallel` on an attention that never calls
# `scaled_dot_product_attention` (`attn_implementation="eager"`), a Mixtral block whose forward
# the expert-parallel adaptation does not reproduce.
#
# ## 6 · Your model at full size, on a real cluster (modelled)
#
# The tiny models above run for real; the same configs at their published sizes are only
# configs (nothing is downloaded), which is all the formulas need. `hf_shape` reads a config as
# the planner's shape, so the lab's memory formulas, and `python -m labkit plan --model SHAPE`,
# read your model. The explorer draws the bytes per GPU of each technique as the GPUs grow.
# Attention runs as the models above run it, through SDPA (FlashAttention's kernel on a GPU):
# the s × s attention scores are never stored, so the activations leave them out; the
# `attention` control switches to an eager attention that keeps them (Korthikanti et al.
# 2022's 5as/h term, against 34 for the rest of a layer's activations: at 4,096 tokens most of
# them). The table after the explorer compares both.

# %%
full_size = {
    "Llama 3 8B": transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "Mixtral 8x7B": transformers.MixtralConfig(),
    "GPT-2": transformers.GPT2Config(),
}
print(hf_shape(full_size["Llama 3 8B"]))
own_model_explorer(full_size)

# %%
from labkit.theory import hardware
from labkit.viz.own_model_widgets import GPU_COUNTS, TECHNIQUES, own_model_bytes

h100 = hardware.gpu("H100").memory_bytes


def fewest_gpus(config, technique, seq=4096, attention="flash"):
    """The fewest of the explorer's GPU counts at which the technique fits an H100, or the
    least it needs and why it can go no further (modelled)."""
    least = None
    for n in GPU_COUNTS:
        got = own_model_bytes(hf_shape(config), technique, n, seq, attention)
        if isinstance(got, str):                   # TP beyond the heads: refused
            return f"no: {least}; {got.split(' (')[0]}"
        if got["total"] <= h100:
            return f"{n} ({got['total'] / 1e9:.1f} GB)"
        least = f"{got['total'] / 1e9:.0f} GB on {n}"
    return f"no: {least}"


pd.DataFrame({t: {f"{name}, {words}": fewest_gpus(config, t, attention=attention)
                  for name, config in full_size.items()
                  for attention, words in (("flash", "SDPA"), ("eager", "scores kept"))}
              for t in TECHNIQUES}).rename_axis(f"fewest H100s ({h100 / 1e9:.1f} GB) that fit, "
                                               "4,096 tokens (modelled)")

# %% [markdown]
# Try: FullyShard on Llama 3 8B stops shrinking near the activations of one sequence (the
# states divide by the GPUs, the activations do not); tensor parallelism divides both, until
# the GPUs no longer divide the 8 KV heads. The table above says which technique first fits
# each model at 4,096 tokens, and at how many GPUs: move the sequence length in the explorer and
# see where each stops fitting. (Lesson 08's recompute and context parallelism are the real
# answers to long sequences.)
#
# ## Exercises
#
# **1 · A plan of your own.** The lab has no preset for Phi (`PhiForCausalLM`, below). Write
# its tensor-parallel plan: a dict `{module name glob: style}` with styles `"colwise"`,
# `"rowwise"`, `"vocab"`, `*` standing for one part of a name (`"model.layers.*.mlp.fc1"`).
# The checker runs 2 AdamW steps with your plan on 2 ranks against one device and reads the
# plan: it says which layer is the other way round, which one is missing, and what the run
# gave. A first wrong answer gets a hint; the plan itself comes with the second, or at once
# with `show_solution()`.

# %%
print(build_phi())

# %% tags=["solution"]
plan = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.dense": "rowwise",
    "model.layers.*.mlp.fc1": "colwise",
    "model.layers.*.mlp.fc2": "rowwise",
    "lm_head": "vocab",
}

# %%
check_own_plan(plan);
