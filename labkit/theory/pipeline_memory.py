"""A pipeline rank's activation memory and sends, from its schedule and its stages' sizes.

Activations. Per micro-batch of b examples a stage saves what its layers keep for backward:
TinyGPT 16sbh + as^2b elements per block, plus the final LayerNorm, head and log-softmax on the
last stage (Korthikanti et al. 2022, arXiv 2205.05198; `memory.tiny_gpt_activation_bytes`); an
MLP each Linear's and each GELU's input, and the final MSE its output and target. A rank holds
at once the micro-batches its schedule has between F and B: GPipe all M, 1F1B at most P - r on
rank r (Narayanan et al. 2021, arXiv 2006.09503), so the peak is read off the schedule (data,
theory/pipeline.py). With recompute only stage inputs are kept between F and B, and one stage's
forward is rebuilt at a time.
Sends: each F's output goes to the next stage, each B's input gradient to the previous one:
4 x b x (boundary elements) bytes in fp32.
No torch here: stages arrive as numbers (the driver, labkit/runs/pipeline.py, measures them).
"""
from .memory import tiny_gpt_activation_bytes


def gpt_stage_activation_bytes(blocks, last, *, seq, batch, hidden, heads, vocab):
    """What a TinyGPT stage of `blocks` blocks saves on a micro-batch (fp32); `last`: it ends
    with the final LayerNorm and head."""
    shape = dict(seq=seq, batch=batch, hidden=hidden, heads=heads, vocab=vocab)
    head = tiny_gpt_activation_bytes(layers=0, **shape)
    per_block = tiny_gpt_activation_bytes(layers=1, **shape) - head
    return blocks * per_block + (head if last else 0)


def mlp_stage_activation_bytes(linears, last, batch):
    """What an MLP stage saves on a micro-batch of `batch` rows (fp32). `linears`: its Linear
    layers as (in, out) features, each followed by a GELU unless it is the model's `last`
    layer, whose MSE keeps output and target."""
    return 4 * batch * (sum(i + o for i, o in linears) + (linears[-1][1] if last else 0))


def stage_sizes(stages, batch, gpt_shape=None):
    """Each stage as `peak_activation_bytes` and `send_bytes` take it: (the activation bytes it
    saves on a micro-batch of `batch`, (input, output) elements per example). `stages`: for the
    TinyGPT of `gpt_shape` (seq, hidden, heads, vocab), (blocks, last) per stage; for the MLP
    (no `gpt_shape`), (its Linears as (in, out) features, last)."""
    if gpt_shape is not None:
        boundary = gpt_shape["seq"] * gpt_shape["hidden"]
        return [(gpt_stage_activation_bytes(blocks, last, batch=batch, **gpt_shape),
                 (boundary, boundary)) for blocks, last in stages]
    return [(mlp_stage_activation_bytes(linears, last, batch), (linears[0][0], linears[-1][1]))
            for linears, last in stages]


def peak_activation_bytes(schedule, rank, stage_bytes, recompute=False):
    """Most activation bytes held at once on `rank`: each F adds its chunk's `stage_bytes`
    until its B (GPipe: M micro-batches, 1F1B: min(M, P - rank)). With recompute only one
    stage's forward is saved at a time, during its backward (the stage inputs kept meanwhile
    are counted as buffers)."""
    if recompute:
        return max(stage_bytes)
    held, now, most = set(), 0, 0
    for kind, m, c in schedule[rank]:
        if kind == "F":
            held.add((m, c))
            now += stage_bytes[c]
            most = max(most, now)
        elif (m, c) in held:
            held.discard((m, c))
            now -= stage_bytes[c]
    return most


def send_bytes(schedule, rank, boundaries, batch, steps=1):
    """Bytes `rank` sends in `steps` steps: each F's output to the next stage, each B's input
    gradient back. `boundaries[c]`: (input, output) elements per example of its chunk c."""
    p, n_stages = len(schedule), len(schedule) * len(boundaries)
    total = 0
    for kind, _, c in schedule[rank]:
        stage = c * p + rank
        if kind == "F" and stage < n_stages - 1:
            total += 4 * batch * boundaries[c][1]
        elif kind == "B" and stage > 0:
            total += 4 * batch * boundaries[c][0]
    return total * steps
