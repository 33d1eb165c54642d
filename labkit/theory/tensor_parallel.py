"""Tensor-parallel formulas: communication per block, memory per rank, modelled step time.

Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053): per transformer block and micro-batch,
2 all-reduces of b*s*h elements in forward and 2 in backward. Sequence parallelism (Korthikanti
et al. 2022, arXiv 2205.05198) turns each all-reduce into an all-gather + a reduce-scatter
(same wire volume) and divides the activations of the LayerNorm regions by t too.
"""
from __future__ import annotations

import pandas as pd

from . import catalog, hardware
from .memory import (activation_bytes_per_layer, dtype_bytes, inference_memory,
                     model_state_bytes, training_memory)
from .step_rate import compute_rate
from .time import collective_time, training_flops, wire_bytes_per_rank

# ------------------------------------------------------------------------ comm per block


def block_comm(batch, seq, hidden, tp, *, sequence_parallel=False, regather=True,
               bytes_per_element=2) -> list[dict]:
    """The collectives one tensor-parallel block runs per micro-batch, forward and backward.

    Rows: direction, op, calls, bytes (payload one rank hands one call), wire_bytes_per_rank
    (all calls). Without sequence parallelism: the g operator after attention and after the
    MLP all-reduces b*s*h in forward; the f operator before them all-reduces in backward.
    With it: forward all-gathers the b*(s/t)*h shard before each column-parallel linear and
    reduce-scatters the b*s*h partial sums after each row-parallel one; backward is the
    reverse, plus (regather=True, as Korthikanti sec. 4.2.2) one more all-gather per column
    linear, since only the sequence shard of its input is kept for the weight gradient.
    """
    full = batch * seq * hidden * bytes_per_element
    t = tp

    def row(direction, op, calls, nbytes):
        return dict(direction=direction, op=op, calls=calls, bytes=nbytes,
                    wire_bytes_per_rank=calls * wire_bytes_per_rank(op, nbytes, t))

    if not sequence_parallel:
        return [row("forward", "all_reduce", 2, full), row("backward", "all_reduce", 2, full)]
    rows = [row("forward", "all_gather", 2, full / t), row("forward", "reduce_scatter", 2, full),
            row("backward", "all_gather", 4 if regather else 2, full / t),
            row("backward", "reduce_scatter", 2, full)]
    return rows


def block_wire_bytes(batch, seq, hidden, tp, **kwargs) -> float:
    """Bytes one rank sends per block and micro-batch (forward + backward), ring algorithm."""
    return sum(r["wire_bytes_per_rank"] for r in block_comm(batch, seq, hidden, tp, **kwargs))


# ----------------------------------------------------------------- labkit's tiny GPT, exactly

def tiny_gpt_replicated_params(*, layers, hidden, seq, sharded_positions=False):
    """Parameters every TP rank holds in full: position embedding (unless the plan splits its
    rows, as sequence parallelism needs), LayerNorms, and the biases added after a
    row-parallel all-reduce (attention proj and fc2)."""
    positions = 0 if sharded_positions else seq * hidden
    return positions + layers * (2 * 2 * hidden + 2 * hidden) + 2 * hidden


def tiny_gpt_params_per_rank(*, layers, hidden, ffn, vocab, seq, tp,
                             sharded_positions=False) -> float:
    """Parameters on one TP rank: sharded ones / t plus the replicated ones (not 1/t exactly)."""
    h, f = hidden, ffn
    sharded = vocab * h + layers * (h * 3 * h + 3 * h + h * h + h * f + f + f * h) + h * vocab
    sharded += seq * h if sharded_positions else 0
    return sharded / tp + tiny_gpt_replicated_params(layers=layers, hidden=hidden, seq=seq,
                                                     sharded_positions=sharded_positions)


def tiny_gpt_comm(*, layers, seq, batch, hidden, vocab, tp, sequence_parallel=False,
                  regather=True, bytes_per_element=4, sharded_positions=False,
                  per_parameter_grad_sync=False) -> dict:
    """{op: {calls, bytes, wire_bytes_per_rank}} for one training step of labkit's TP tiny GPT.

    Blocks: `block_comm` each. Outside them: the vocab-parallel embedding (all-reduce, or
    reduce-scatter + all-gather in backward with SP), the head's input (f: all-reduce in
    backward; with SP all-gather + reduce-scatter + regather), the vocab-parallel
    cross-entropy (3 all-reduces of b*s: max, target logit, sum of exp) and, with SP, one
    all-reduce of the replicated parameters' gradients (each rank saw only its sequence shard).
    `sharded_positions`: the position table split by rows too (labkit.parallelize's plan with
    SP): a reduce-scatter of s*h forward, an all-gather of its s/t*h shard backward, and no
    gradient sync for it. `per_parameter_grad_sync`: one all-reduce per replicated tensor (h
    elements each: 6 per layer + the final LayerNorm's 2), as parallelize's hooks do, instead
    of one flat all-reduce.
    """
    B, t = bytes_per_element, tp
    full, tokens = batch * seq * hidden * B, batch * seq * B
    calls = []  # (op, calls, payload bytes per call)
    for r in block_comm(batch, seq, hidden, tp, sequence_parallel=sequence_parallel,
                        regather=regather, bytes_per_element=B):
        calls += [(r["op"], r["calls"], r["bytes"])] * layers
    if sequence_parallel:
        calls += [("reduce_scatter", 1, full), ("all_gather", 1, full / t),   # embedding
                  ("all_gather", 2 if regather else 1, full / t),             # head input
                  ("reduce_scatter", 1, full)]
        if sharded_positions:
            table = seq * hidden * B                                          # positions
            calls += [("reduce_scatter", 1, table), ("all_gather", 1, table / t)]
        if per_parameter_grad_sync:                                           # SP grads
            calls += [("all_reduce", 6 * layers + 2, hidden * B)]
        else:
            calls += [("all_reduce", 1, tiny_gpt_replicated_params(
                layers=layers, hidden=hidden, seq=seq,
                sharded_positions=sharded_positions) * B)]
    else:
        calls += [("all_reduce", 1, full), ("all_reduce", 1, full)]           # embedding, head
    calls += [("all_reduce", 3, tokens)]                                      # cross-entropy
    out = {}
    for op, n, nbytes in calls:
        row = out.setdefault(op, dict(calls=0, bytes=0.0, wire_bytes_per_rank=0.0))
        row["calls"] += n
        row["bytes"] += n * nbytes
        row["wire_bytes_per_rank"] += n * wire_bytes_per_rank(op, nbytes, t)
    return out


def tiny_gpt_activation_bytes(*, layers, seq, batch, hidden, heads, vocab, ffn, tp=1,
                              sequence_parallel=False, regather=True,
                              bytes_per_element=4) -> float:
    """Bytes one TP rank saves for backward in labkit's tiny GPT (fp32, no dropout).

    Korthikanti et al. 2022's accounting (see theory.memory.tiny_gpt_activation_bytes, t=1)
    split by where each tensor lives. Per layer, in elements:
      replicated (without SP): 2 LayerNorm inputs + the 2 LayerNorm outputs that enter the
        column-parallel linears = 4sbh
      sharded by heads / ffn: Q, K, V 3sbh/t, attention output sbh/t, softmax as^2b/t,
        GELU input and output 2sfb/t (8sbh/t for f = 4h)
    => 4sbh + (4sbh + 2sfb + as^2b)/t; with f = 4h that is Korthikanti's 10 + 24/t shape
    (their 16-bit + dropout bytes: sbh(10 + 24/t + 5as/(ht))). With SP (and regather) the
    replicated 4sbh is sharded along the sequence too: (8sbh + 2sfb + as^2b)/t, their
    sbh/t (34 + 5as/h). Outside the blocks: final LayerNorm input and head input (sbh each,
    /t with SP) and the softmax of the vocab-parallel cross-entropy bsV/t.
    """
    s, b, h, a, f, t = seq, batch, hidden, heads, ffn, tp
    sbh = s * b * h
    sharded = (4 * sbh + 2 * s * b * f + a * s * s * b) / t
    if not sequence_parallel:
        ln_inputs, linear_inputs = 2 * sbh, 2 * sbh        # per layer
        final_ln_input, head_input = sbh, sbh
    else:  # LayerNorms run on the sequence shard; regather keeps only the shard of an input
        ln_inputs, linear_inputs = 2 * sbh / t, 2 * sbh / (t if regather else 1)
        final_ln_input, head_input = sbh / t, sbh / (t if regather else 1)
    outside = final_ln_input + head_input + b * s * vocab / t
    return (layers * (ln_inputs + linear_inputs + sharded) + outside) * bytes_per_element


def tiny_gpt_run_comm(*, steps, layers, seq, batch, hidden, vocab, tp, sequence_parallel=False,
                      regather=True) -> dict:
    """`tiny_gpt_comm` of a whole fp32 run of labkit's plan (`steps` steps; with SP the position
    table split by rows; one all-reduce per replicated tensor, as parallelize's hooks do)."""
    step = tiny_gpt_comm(layers=layers, seq=seq, batch=batch, hidden=hidden, vocab=vocab, tp=tp,
                         sequence_parallel=sequence_parallel, regather=regather,
                         sharded_positions=sequence_parallel, per_parameter_grad_sync=True)
    return {op: {k: v * steps for k, v in row.items()} for op, row in step.items()}


def tiny_gpt_training_memory(*, layers, hidden, heads, ffn, vocab, seq, batch, tp,
                             optimizer="adam", sequence_parallel=False, regather=True) -> dict:
    """Bytes per TP rank of labkit's fp32 run: model states of the rank's parameters (the
    position table split with SP, as labkit's plan does) and `tiny_gpt_activation_bytes`."""
    n = tiny_gpt_params_per_rank(layers=layers, hidden=hidden, ffn=ffn, vocab=vocab, seq=seq,
                                 tp=tp, sharded_positions=sequence_parallel)
    states = model_state_bytes(n, mixed_precision=False, optimizer=optimizer)
    out = {k: states[k] for k in ("params", "grads", "optimizer")}
    out["activations"] = tiny_gpt_activation_bytes(
        layers=layers, seq=seq, batch=batch, hidden=hidden, heads=heads, vocab=vocab, ffn=ffn,
        tp=tp, sequence_parallel=sequence_parallel, regather=regather)
    out["peak"] = sum(out.values())
    return out


def korthikanti_bytes_per_layer(seq, batch, hidden, heads, tp, sequence_parallel=False):
    """Korthikanti et al. 2022 per-layer bytes (16-bit, with dropout masks), for comparison."""
    return activation_bytes_per_layer(seq, batch, hidden, heads, tp=tp,
                                      sequence_parallel=sequence_parallel)


# --------------------------------------------------------------------- real models, modelled

def cluster_for(tp, gpus_per_node=8, gpu="H100"):
    """TP inside one NVLink node up to 8; beyond that the group spans nodes over InfiniBand."""
    nodes = -(-tp // gpus_per_node)
    return hardware.cluster(f"{nodes}x{gpus_per_node}x{gpu}-IB" if nodes > 1
                            else f"{gpus_per_node}x{gpu}-NVLink")


def step_time(model, tp, *, batch=1, seq=4096, cluster=None, link=None,
              sequence_parallel=False, dtype="bf16", overlap=0.0) -> dict:
    """Modelled seconds for one training micro-batch of `batch` x `seq` tokens on a TP group.

    compute = (6 N_matmul + 12 L h s) * tokens / t / F (theory.time.training_flops; F the
    in-step GEMM rate, step_rate.compute_rate, the run clock's);
    comm = layers * the collectives of `block_comm` (alpha-beta over the group's link: NVLink
    inside a node, InfiniBand once the group spans nodes). Megatron's TP collectives sit on the
    critical path (each layer waits for its all-reduce), so exposed = comm * (1 - overlap);
    SP's backward regather can hide under the weight-gradient matmul and is never exposed.
    `link` (a name) overrides the link the group would use on `cluster`. Not modelled:
    smaller matmuls running below the in-step GEMM rate at large t.
    """
    m = catalog.model(model) if not isinstance(model, catalog.ModelShape) else model
    c = hardware.cluster(cluster) if cluster is not None else cluster_for(tp)
    link = hardware.link(link) if link is not None else c.link_for(range(tp))
    flops = training_flops(m, batch * seq, seq=seq)   # matmuls + attention, no embedding
    compute = flops / tp / compute_rate(c.gpu, dtype)
    comm = hidden_comm = 0.0
    if tp > 1:
        for r in block_comm(batch, seq, m.hidden, tp, sequence_parallel=sequence_parallel,
                            bytes_per_element=dtype_bytes(dtype)):
            per_call = collective_time(r["op"], r["bytes"], tp, link)
            calls = r["calls"]
            if sequence_parallel and r["direction"] == "backward" and r["op"] == "all_gather":
                hidden_comm += m.layers * (calls - 2) * per_call  # the regathers
                calls = 2
            comm += m.layers * calls * per_call
    exposed = comm * (1 - overlap)
    total = compute + exposed
    return dict(tp=tp, link=link.name, compute=compute, comm=comm + hidden_comm,
                exposed_comm=exposed, total=total, exposed_share=exposed / total)


def step_time_table(model="llama-3-70b", tps=(1, 2, 4, 8, 16), *, batch=1, seq=4096,
                    sequence_parallel=False) -> pd.DataFrame:
    """step_time for each TP degree, with speedup over t=1 and GPU-seconds relative to t=1
    (the cost: t GPUs for `total` seconds)."""
    rows = [step_time(model, t, batch=batch, seq=seq, sequence_parallel=sequence_parallel)
            for t in tps]
    df = pd.DataFrame(rows).set_index("tp")
    t1 = df["total"].iloc[0] * df.index[0]
    df["speedup_vs_tp1"] = df["total"].iloc[0] / df["total"]
    df["gpu_seconds_vs_tp1"] = df["total"] * df.index / t1
    return df


def inference_table(model="llama-3-70b", tps=(2, 4, 8), dtypes=("bf16", "int8", "int4"), *,
                    batch=8, context=8192, kv_dtype="bf16") -> pd.DataFrame:
    """Weights and KV cache per GPU (GB = 1e9 bytes) for serving `model` with TP = t
    (theory.memory.inference_memory: weights / t, KV heads split up to kv_heads)."""
    rows = []
    for t in tps:
        for d in dtypes:
            mem = inference_memory(model, batch=batch, context=context, weight_dtype=d,
                                   kv_dtype=kv_dtype, tp=t)
            rows.append(dict(tp=t, weights=d, weights_gb=mem["weights"] / 1e9,
                             kv_cache_gb=mem["kv_cache"] / 1e9, total_gb=mem["total"] / 1e9))
    return pd.DataFrame(rows)


def training_memory_per_gpu(model, tp, *, batch=1, seq=4096, sequence_parallel=False) -> dict:
    """Mixed-precision Adam bytes per GPU with TP = t (theory.memory.training_memory)."""
    return training_memory(model, batch=batch, seq=seq, tp=tp,
                           sequence_parallel=sequence_parallel)
