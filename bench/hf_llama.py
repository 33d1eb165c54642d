"""labkit's blocks against PyTorch's own on a small Hugging Face Llama, in one run.

A `LlamaForCausalLM` built from a config (random weights, nothing downloaded; GQA: 8 query
heads, 4 key/value heads), AdamW, gloo on CPU, world size 2. Three pairs, each the same model
and data on both sides:
  DistributedDataParallel(model, bucket_cap_mb=25)  vs  torch's (bucket_cap_mb=25 / 1.048576)
  FullyShard (the FSDP1 variant; units=decoder layers + root)  vs  torch's fully_shard (FSDP2)
      on each decoder layer, then the root
  parallelize_module(model, None, the llama preset's attention and MLP entries)  vs  torch's
      (ColwiseParallel / RowwiseParallel on the same names; the vocab entries left out on both,
      torch has no vocab-parallel cross-entropy for an HF head)
Every side is built once per rank; then `interleaved_rounds` measures them in rounds whose
order alternates (no side always runs on the warmer machine), one warm-up round unrecorded;
a round's value is the slowest rank's wall time for TIMED steps (`slowest_rank_timer`) / TIMED.
Instrumentation off on labkit's side (`ctx.off_the_record()`: no comm log, no virtual clock).
A row per pair: step_time_s_median, labkit_over_torch = labkit / torch (the median of the
per-round ratios; below 1 labkit is faster) with the spread (min-max of those ratios), and
each pair's losses checked equal-ish first (the first step's loss on both sides, printed).
Run: python bench/hf_llama.py   (rows replace their configurations' rows in data/bench.csv)
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from common import compared_row, interleaved_rounds, replace_rows, slowest_rank_timer  # noqa
from labkit import data  # noqa: E402

CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
              bos_token_id=0, eos_token_id=None, pad_token_id=0)
WORLD, BATCH, SEQ = 2, 8, 64
TIMED, ROUNDS = 3, 5
# the labels key this bench's rows in data/bench.csv: torch's names on both sides
PAIRS = {
    "data_parallel": ("DistributedDataParallel(bucket_cap_mb=25)",
                      "DistributedDataParallel(bucket_cap_mb=25 MB)"),
    "fully_shard": ("FullyShard (FSDP1 variant; decoder layers + root)",
                    "fully_shard (FSDP2; each decoder layer, then the root)"),
    "tensor_parallel": ("parallelize_module(llama preset, attention + MLP)",
                        "parallelize_module(Colwise/RowwiseParallel, same names)"),
}


def build():
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(attn_implementation="sdpa", **CONFIG)
    return transformers.LlamaForCausalLM(config).train()


def _is_layer(module):
    return type(module).__name__ == "LlamaDecoderLayer"


def wrap(block, side, ctx):
    """The model for one side of one pair, and whether it sees this rank's shard of the batch
    (data parallel) or the whole batch (tensor parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    model = build()
    if block == "data_parallel":
        if side == "labkit":
            from labkit.parallel.data_parallel import DistributedDataParallel
            # buffers (RoPE's inv_freq) broadcast once, as this bench always measured
            return DistributedDataParallel(model, bucket_cap_mb=25.0,
                                           forward_sync_buffers=False), True
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, bucket_cap_mb=25 / 1.048576), True
    if block == "fully_shard":
        if side == "labkit":
            from labkit.parallel.fully_shard import FullyShard
            return FullyShard(model, units=lambda m: m is model or _is_layer(m)), True
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh), True
    from labkit.parallel.parallel_styles import parallelize_module as labkit_parallelize
    from labkit.parallel.tp_presets import tp_plan_for
    plan = {k: v for k, v in tp_plan_for(model).items() if v != "vocab"}
    if side == "labkit":
        return labkit_parallelize(model, None, plan), False
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, init_device_mesh("cpu", (ctx.world_size,)),
                       {k: styles[v]() for k, v in plan.items()})
    return model, False


def on_ranks(ctx):
    sides, first_loss = {}, {}
    with ctx.off_the_record():
        for block in PAIRS:
            for side in ("labkit", "torch"):
                model, shard = wrap(block, side, ctx)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                counter = [0]

                def step(model=model, opt=opt, shard=shard, counter=counter, key=(block, side)):
                    for _ in range(TIMED):
                        g = torch.Generator().manual_seed(counter[0])
                        ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
                        if shard:
                            ids = data.shard(ids, ctx.rank, ctx.world_size)
                        opt.zero_grad(set_to_none=True)
                        # ["loss"]: a wrapper may hand back the output as a plain dict
                        loss = model(input_ids=ids, labels=ids)["loss"]
                        loss.backward()
                        if hasattr(model, "finish_gradient_synchronization"):
                            model.finish_gradient_synchronization()
                        opt.step()
                        first_loss.setdefault(key, loss.item())
                        counter[0] += 1
                sides[(block, side)] = slowest_rank_timer(step)
        values = interleaved_rounds(sides, rounds=ROUNDS)
    return {k: [v / TIMED for v in vals] for k, vals in values.items()}, first_loss


def main():
    t0 = time.time()
    results = labkit.launch(on_ranks, WORLD, timeout_s=1800)
    values, losses = results[0]
    params = sum(p.numel() for p in build().parameters())
    setting = (f"HF LlamaForCausalLM h{CONFIG['hidden_size']} L{CONFIG['num_hidden_layers']} "
               f"{CONFIG['num_attention_heads']}q/{CONFIG['num_key_value_heads']}kv heads "
               f"vocab {CONFIG['vocab_size']}, {params / 1e6:.2f}M params; batch {BATCH} x "
               f"{SEQ} tokens; AdamW fp32; gloo CPU, world {WORLD}; {ROUNDS} interleaved "
               f"rounds x {TIMED} timed steps; instrumentation off")
    print(setting, f"({time.time() - t0:.0f} s)")
    rows = []
    print(f"{'block':16}{'labkit ms':>10}{'torch ms':>10}{'labkit/torch':>14}{'spread':>14}"
          f"{'first loss labkit / torch':>30}")
    for block, (mine, theirs) in PAIRS.items():
        row = compared_row(dict(benchmark="hf_llama", labkit_impl=mine, torch_impl=theirs,
                                world_size=WORLD), "step_time_s_median",
                           values[(block, "labkit")], values[(block, "torch")],
                           notes=f"{setting}; first-step loss labkit "
                                 f"{losses[(block, 'labkit')]:.4f}, torch "
                                 f"{losses[(block, 'torch')]:.4f}")
        rows.append(row)
        print(f"{block:16}{float(row['labkit']) * 1e3:10.1f}{float(row['torch']) * 1e3:10.1f}"
              f"{row['labkit_over_torch']:>14}"
              f"{row['spread_min'] + '-' + row['spread_max']:>14}"
              f"{losses[(block, 'labkit')]:>15.4f} / {losses[(block, 'torch')]:.4f}")
    replace_rows(rows)
    print(f"{len(rows)} rows written to data/bench.csv")


if __name__ == "__main__":
    main()
