"""Data parallelism: every rank holds the whole model and trains on its own slice of the batch.

The idea. N replicas start from the same weights. Each takes 1/N of the global batch, runs
forward and backward on it, and then the ranks *average their gradients* with an all-reduce.
Because the loss is a mean over examples, the average of the N shard gradients is exactly the
gradient of the full batch, so every replica takes the same optimizer step as one device on the
whole batch would: same numbers, N times less compute per rank.

The price. Each step every rank must exchange its gradients. With a ring all-reduce of S bytes
(reduce-scatter, then all-gather, each N-1 steps of one S/N chunk) each rank sends

    2 (N - 1) / N  x  S   bytes per step,

which is below 2S whatever N is: the per-rank traffic does not grow with the number of GPUs,
which is why data parallelism scales (Patarasuk & Yuan 2009). The time is that traffic over the
link, so it *does not shrink* as N grows while the compute does: at some N the all-reduce is the
step. Hiding it under backward is the next trick.

What is here, top to bottom:
- `train(ctx, cfg, mode, bucket_mb, overlap, accumulate)`: naive (one all-reduce per gradient
  after backward) or bucketed (gradients grouped into ~bucket_mb buckets in reverse order of use;
  a hook launches each bucket's async all-reduce as soon as it is full, so communication
  overlaps the rest of backward: what PyTorch DDP does, Li et al. 2020, arXiv 2006.15704), and
  gradient accumulation (K micro-batches, one sync).
- `ring_all_reduce(ctx, tensor)`: the ring written from send/recv; `check_ring_all_reduce(fn)`
  checks a learner's version on 4 ranks and says in words what is wrong.
- `infer(ctx, cfg, batches)` and `inference_throughput(...)`: one batch per replica; throughput
  grows with replicas, latency per batch does not.
- `add_arguments` / `report`: `python -m labkit run dp --world-size N [--bucket-mb X]
  [--no-overlap] [--accumulate K] [--mode naive|bucketed] --json`.
"""
import math
import time
from dataclasses import dataclass

import torch

from . import data
from .runs.reference import RunConfig, batch, build_model, build_optimizer, full_params
from .runs.report import build_report, rank_result

DEFAULT_BUCKET_MB = 0.25   # the tiny model's gradients are ~0.47 MB: two buckets
MODES = ("bucketed", "naive")


# ------------------------------------------------------------------------------------- training

def train(ctx, cfg=None, mode="bucketed", bucket_mb=DEFAULT_BUCKET_MB, overlap=True,
          accumulate=1):
    """Data-parallel training on this rank; returns `rank_result` (params on rank 0).

    The losses it returns are this rank's (its shard's mean); `global_loss(results)` averages
    them over ranks into the full-batch loss (equal shards: the mean of means is the mean).
    """
    cfg = cfg or RunConfig()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if accumulate < 1 or cfg.global_batch % (ctx.world_size * accumulate):
        raise ValueError(f"global batch {cfg.global_batch} must split into {ctx.world_size} "
                         f"ranks x {accumulate} micro-batches")
    model = build_model(cfg)            # same seed on every rank: identical replicas
    optimizer = build_optimizer(model.parameters(), cfg)
    ctx.memory.watch(model=model, optimizer=optimizer)
    buckets = GradBuckets(ctx, model, bucket_mb, overlap) if mode == "bucketed" else None
    losses, step_wall = [], []
    for step in range(cfg.steps):
        started = time.perf_counter()
        x, y = batch(model, cfg, step)  # the global batch; keep my slice of it
        x, y = data.shard(x, ctx.rank, ctx.world_size), data.shard(y, ctx.rank, ctx.world_size)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        with ctx.memory.track_activations():
            for k, (mx, my) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
                last = k == accumulate - 1
                if buckets is not None:
                    buckets.sync = last  # no communication on the inner micro-steps
                which = "" if accumulate == 1 else f" (micro-batch {k})"
                with ctx.clock.compute("forward" + which):
                    # Scaled so the K micro-gradients add up to the shard's mean gradient.
                    loss = model(mx, my) / accumulate
                with ctx.clock.compute("backward" + which):  # bucket hooks fire in here
                    loss.backward()
                loss_sum += loss.item()
        if buckets is None:
            all_reduce_each_gradient(ctx, model)
        else:
            buckets.finish()           # launch what is left, wait for all, copy into .grad
        with ctx.clock.compute("optimizer step"):
            optimizer.step()
        ctx.memory.sample(f"after step {step}")
        ctx.clock.mark_step()
        ctx.progress(step + 1, cfg.steps)
        losses.append(loss_sum)
        step_wall.append(time.perf_counter() - started)
    return rank_result(ctx, losses, params=full_params(model) if ctx.rank == 0 else None,
                       local_loss=losses, step_wall_s=step_wall)


def all_reduce_each_gradient(ctx, model):
    """Naive: after backward, one blocking all-reduce (average) per parameter tensor."""
    for name, p in model.named_parameters():
        if p.grad is not None:
            ctx.comm.tag = f"grad {name}"
            ctx.comm.all_reduce(p.grad, op="avg")
    ctx.comm.tag = ""


class GradBuckets:
    """Gradients grouped into flat buckets in reverse order of use, reduced as they fill.

    Backward produces gradients roughly in reverse of `model.parameters()` order, so bucket 0
    holds the last layers and is full first. A post-accumulate-grad hook per parameter copies
    its gradient into its slot; when a bucket is full (and every earlier bucket was launched:
    all ranks must issue collectives in one order) its async all-reduce starts. With
    `overlap=False` all buckets start after backward instead. `finish()` waits for every
    bucket and copies the averages back into `p.grad`.
    """

    def __init__(self, ctx, model, bucket_mb=DEFAULT_BUCKET_MB, overlap=True):
        self.ctx, self.overlap = ctx, overlap
        self.sync = True
        cap = bucket_mb * 1e6
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        groups, current, size = [], [], 0
        for p in params:
            if current and (size >= cap or p.dtype != current[-1].dtype):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            groups.append(current)
        self.buckets, self.slot = [], {}
        for i, group in enumerate(groups):
            flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype,
                               device=group[0].device)
            offset = 0
            for p in group:
                self.slot[p] = (i, offset, p.numel())
                offset += p.numel()
            self.buckets.append(dict(params=group, flat=flat, ready=0, handle=None))
            ctx.memory.add_buffer(f"grad bucket {i}", flat)
        self.next = 0  # the next bucket to launch
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def sizes(self):
        """Bytes per bucket, in launch order."""
        return [b["flat"].nbytes for b in self.buckets]

    def _on_grad(self, p):
        if not self.sync:
            return
        i, offset, n = self.slot[p]
        bucket = self.buckets[i]
        bucket["flat"][offset:offset + n].copy_(p.grad.reshape(-1))
        bucket["ready"] += 1
        if self.overlap:
            self._launch(only_full=True)

    def _launch(self, only_full):
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if only_full and bucket["ready"] < len(bucket["params"]):
                return
            for p in bucket["params"]:   # a parameter that got no gradient reduces zeros
                if p.grad is None:
                    i, offset, n = self.slot[p]
                    bucket["flat"][offset:offset + n].zero_()
            self.ctx.comm.tag = f"bucket {self.next}"
            bucket["handle"] = self.ctx.comm.all_reduce(bucket["flat"], op="avg", async_op=True)
            self.ctx.comm.tag = ""
            self.next += 1

    def finish(self):
        self._launch(only_full=False)
        for bucket in self.buckets:
            bucket["handle"].wait()
            for p in bucket["params"]:
                _, offset, n = self.slot[p]
                averaged = bucket["flat"][offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = averaged.clone()
                else:
                    p.grad.copy_(averaged)
            bucket["ready"], bucket["handle"] = 0, None
        self.next = 0


def global_loss(results):
    """The full-batch loss per step: the mean over ranks of each rank's shard loss."""
    per_rank = [r["local_loss"] for r in results]
    return [sum(step) / len(step) for step in zip(*per_rank)]


def gradient_bytes(cfg):
    """Bytes of one full set of gradients (what every rank all-reduces per step)."""
    model = build_model(cfg)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def predicted_wire_bytes(grad_bytes, world_size, steps=1):
    """Ring all-reduce: each rank sends 2(N-1)/N x gradient bytes per step."""
    n = world_size
    return 2 * (n - 1) / n * grad_bytes * steps


# ---------------------------------------------------------------------- a ring from send/recv

def ring_all_reduce(ctx, tensor, op="sum"):
    """Sum (or average) `tensor` over all ranks in place, with only send and recv.

    Cut the tensor into N chunks. Reduce-scatter: in step s (of N-1) rank r sends chunk
    (r - s) mod N to its right neighbour and adds what its left neighbour sends into chunk
    (r - s - 1) mod N; afterwards rank r owns the full sum of chunk (r + 1) mod N. All-gather:
    N-1 more steps pass the finished chunks around the ring. Each rank sent 2(N-1) chunks of
    S/N bytes: 2(N-1)/N x S. Sends are async (post the send, then receive, then wait): if every
    rank first waited in recv, nobody would ever send.
    """
    n, r = ctx.world_size, ctx.rank
    if n == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    chunks = list(torch.tensor_split(flat, n))
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):                        # reduce-scatter
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        ctx.comm.tag = f"ring reduce-scatter step {s}"
        handle = ctx.comm.send(chunks[send_i], right, async_op=True)
        ctx.comm.recv(incoming, left)
        handle.wait()
        chunks[recv_i].add_(incoming)
    for s in range(n - 1):                        # all-gather
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        ctx.comm.tag = f"ring all-gather step {s}"
        handle = ctx.comm.send(chunks[send_i], right, async_op=True)
        ctx.comm.recv(chunks[recv_i], left)
        handle.wait()
    ctx.comm.tag = ""
    if op == "avg":
        flat.div_(n)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


@dataclass
class RingCheck:
    """What `check_ring_all_reduce` found: ok, a one-word problem, and plain-words advice."""
    ok: bool
    problem: str   # "", "wrong sum", "wrong chunk", "deadlock", "too many bytes", "error"
    message: str

    def __repr__(self):
        return self.message

    _repr_pretty_ = lambda self, p, cycle: p.text(self.message)  # noqa: E731


def _ring_input(rank, numel):
    """Distinct, exactly summable values per rank (small integers: no float rounding)."""
    return torch.arange(numel, dtype=torch.float32) + 100.0 * (rank + 1)


def _run_user_ring(ctx, user_fn, numel):
    tensor = _ring_input(ctx.rank, numel)
    original = tensor.clone()
    out = user_fn(ctx, tensor)
    got = out if isinstance(out, torch.Tensor) else tensor
    sent = sum(rec.bytes for rec in ctx.comm.records if rec.op == "send")
    others = sorted({rec.op for rec in ctx.comm.records if rec.op not in ("send", "recv")})
    return dict(rank=ctx.rank, got=got.detach().clone().reshape(-1), input=original,
                sent_bytes=sent, other_ops=others)


def check_ring_all_reduce(user_fn, world_size=4, numel=16, timeout_s=20.0, verbose=True):
    """Run `user_fn(ctx, tensor)` on `world_size` ranks and say, in words, whether it all-reduces.

    Every rank hands in a different float32 tensor of `numel` elements; the sum over ranks is
    expected back (returned, or written into `tensor`). Checks: the values, which chunks are
    wrong, a deadlock (the run times out), and the bytes sent against the ring's 2(N-1)/N x S.
    """
    from .runtime.launch import LaunchError, launch
    n = world_size
    try:
        results = launch(_run_user_ring, n, user_fn, numel, timeout_s=timeout_s)
    except LaunchError as error:
        text = str(error)
        if "timed out" in text:
            waits = "\n".join(line for line in text.splitlines() if line.startswith("  rank"))
            check = RingCheck(False, "deadlock", (
                f"Deadlock: the ranks were still waiting after {timeout_s:g} s.\n{waits}\n"
                "Every rank is blocked waiting for a message that nobody sends: if each rank "
                "first waits in recv, no send is ever posted. Post the send first without "
                "waiting for it (handle = ctx.comm.send(chunk, right, async_op=True)), then "
                "recv from the left, then handle.wait()."))
        else:
            last = [line for line in text.strip().splitlines() if line.strip()][-1]
            check = RingCheck(False, "error", f"Your function raised an error: {last}\n\n{text}")
        return _say(check, verbose)
    expected = sum(_ring_input(r, numel) for r in range(n))
    bad = [res for res in results if not torch.equal(res["got"], expected)]
    if bad:
        check = _diagnose(bad[0], expected, n)
    else:
        limit = 2 * (n - 1) / n * numel * 4
        worst = max(results, key=lambda res: res["sent_bytes"])
        cheat = sorted({op for res in results for op in res["other_ops"]})
        if cheat:
            check = RingCheck(False, "not a ring", (
                f"The sums are right, but you called {', '.join(cheat)}: build the ring from "
                "ctx.comm.send and ctx.comm.recv only."))
        elif worst["sent_bytes"] > limit + 1e-9:
            check = RingCheck(False, "too many bytes", (
                f"The sums are right, but rank {worst['rank']} sent {worst['sent_bytes']} bytes; "
                f"a ring all-reduce sends 2(N-1)/N x S = 2x{n - 1}/{n} x {numel * 4} = "
                f"{limit:.0f} bytes per rank. Send one chunk (S/N) per step, N-1 steps per "
                "phase, not the whole tensor."))
        else:
            check = RingCheck(True, "", (
                f"Correct: all {n} ranks hold the sum, and each rank sent "
                f"{worst['sent_bytes']} bytes = 2(N-1)/N x S = 2x{n - 1}/{n} x {numel * 4} "
                "bytes, the least any all-reduce can send."))
    return _say(check, verbose)


def _diagnose(res, expected, n):
    got, rank = res["got"], res["rank"]
    if got.numel() != expected.numel():
        return RingCheck(False, "wrong chunk", (
            f"Rank {rank} handed back {got.numel()} elements, expected {expected.numel()}: "
            "return (or fill in) the whole tensor, not one chunk."))
    want_chunks = list(torch.tensor_split(expected, n))
    got_chunks = list(torch.tensor_split(got, n))
    right = [i for i in range(n) if torch.equal(got_chunks[i], want_chunks[i])]
    show = f"rank {rank}: expected {_short(expected)}\n        got      {_short(got)}"
    if torch.equal(got, res["input"]):
        return RingCheck(False, "wrong sum", (
            f"Nothing was reduced: rank {rank} still holds its own input.\n{show}\n"
            "Add what you receive into your chunk (chunk += incoming) and write the result back "
            "into the tensor you were given (or return it)."))
    if torch.allclose(got * n, expected):
        return RingCheck(False, "wrong sum", (
            f"You averaged instead of summing (got = sum / {n}).\n{show}"))
    placed = all(any(torch.equal(g, w) for w in want_chunks) for g in got_chunks)
    if placed and len(right) < n:
        return RingCheck(False, "wrong chunk", (
            f"Every chunk on rank {rank} is a correct sum, but in the wrong place: chunks "
            f"{[i for i in range(n) if i not in right]} hold another chunk's values.\n{show}\n"
            "Check the indices: in reduce-scatter step s rank r sends chunk (r - s) mod N and "
            "receives chunk (r - s - 1) mod N; in all-gather step s it sends (r + 1 - s) mod N "
            "and receives (r - s) mod N."))
    if right:
        wrong = [i for i in range(n) if i not in right]
        return RingCheck(False, "wrong chunk", (
            f"Rank {rank} has chunks {right} right and chunks {wrong} wrong.\n{show}\n"
            "Each chunk must travel the whole ring: N-1 reduce-scatter steps (adding) and then "
            "N-1 all-gather steps (copying the finished chunk). A chunk that stops early holds "
            "a partial sum or stale values."))
    return RingCheck(False, "wrong sum", (
        f"Wrong sum on rank {rank}.\n{show}\n"
        "In reduce-scatter add the received chunk into yours; in all-gather copy it over yours."))


def _short(t, k=8):
    values = ", ".join(f"{v:g}" for v in t[:k].tolist())
    return f"[{values}{', ...' if t.numel() > k else ''}]"


def _say(check, verbose):
    if verbose:
        print(check.message)
    return check


# ------------------------------------------------------------------------------- inference

def infer(ctx, cfg=None, batches=()):
    """Inference data parallelism: replica r runs batches r, r+N, r+2N, ... on its own copy.

    No communication at all: each batch is independent. Returns this rank's outputs
    ({batch index: output}) and the modelled seconds of each of its batches.
    """
    cfg = cfg or RunConfig()
    model = build_model(cfg).eval()
    outputs, times = {}, []
    for i in range(ctx.rank, len(batches), ctx.world_size):
        start = ctx.clock.now()
        with torch.no_grad(), ctx.clock.compute(f"batch {i}"):
            outputs[i] = model(batches[i])
        times.append(ctx.clock.now() - start)
        ctx.clock.mark_step()
    return dict(rank=ctx.rank, outputs=outputs, batch_s=times, finished_s=ctx.clock.now(),
                timeline=ctx.clock.timeline(), wall_s=ctx.elapsed())


def inference_throughput(batch_latency_s, replicas, batches):
    """Closed form for independent batches on `replicas` copies, each `batch_latency_s` a batch.

    makespan = ceil(batches / replicas) x latency; throughput = batches / makespan; the latency
    of any one batch stays `batch_latency_s`. With fewer batches than replicas some replicas idle.
    """
    rounds = math.ceil(batches / replicas) if batches else 0
    makespan = rounds * batch_latency_s
    busy = batches * batch_latency_s / (replicas * makespan) if makespan else 0.0
    return dict(replicas=replicas, batches=batches, latency_s=batch_latency_s,
                makespan_s=makespan, throughput_per_s=batches / makespan if makespan else 0.0,
                seconds_per_batch=makespan / batches if batches else float("nan"),
                utilisation=busy)


# ----------------------------------------------------------------------------- CLI and report

def add_arguments(parser):
    """Options of `python -m labkit run dp`."""
    parser.add_argument("--mode", choices=MODES, default="bucketed",
                        help="bucketed (DDP-style, async) or naive (one all-reduce per tensor)")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB,
                        help="gradient bucket size in MB (1e6 bytes)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="start the bucket all-reduces after backward, not during it")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per step (gradient accumulation, one sync)")


def predict_memory(cfg, world_size, mode="bucketed", accumulate=1):
    """Bytes per rank (theory/): a full replica of params, grads and Adam state on every rank,
    activations for global_batch / (N x K) examples, plus one flat copy of the gradients as
    buckets in bucketed mode. `peak` adds them all (an upper bound)."""
    from .runs.reference import activation_bytes, predict_memory as single
    model = build_model(cfg)
    out = single(cfg, model)
    out["activations"] = activation_bytes(model, cfg.global_batch // (world_size * accumulate))
    out["buffers"] = gradient_bytes(cfg) if mode == "bucketed" else 0
    out["peak"] = sum(out[k] for k in ("params", "grads", "optimizer", "activations", "buffers"))
    return out


def report(world_size=2, cfg=None, cluster="8xH100-NVLink", bucket_mb=DEFAULT_BUCKET_MB,
           no_overlap=False, accumulate=1, mode="bucketed", **_):
    """Run data-parallel training and return the run report of DESIGN.md."""
    from .runtime.launch import launch
    cfg = cfg or RunConfig()
    results = launch(train, world_size, cfg, mode=mode, bucket_mb=bucket_mb,
                     overlap=not no_overlap, accumulate=accumulate, cluster=cluster)
    loss = global_loss(results)
    results[0] = dict(results[0], loss=loss)
    grad_bytes = gradient_bytes(cfg)
    return build_report(
        "dp", cfg, results,
        config=dict(mode=mode, bucket_mb=bucket_mb, overlap=not no_overlap,
                    accumulate=accumulate, gradient_bytes=grad_bytes),
        predicted_memory=predict_memory(cfg, world_size, mode, accumulate),
        predicted_comm_bytes_per_rank=predicted_wire_bytes(grad_bytes, world_size, cfg.steps))
