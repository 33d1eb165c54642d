"""Iteration-level scheduling of a request stream: continuous batching and chunked prefill.

Static batching (request-level, as servers before Orca): when the engine is idle it takes up
to `max_num_seqs` waiting requests and runs them until the last one finishes; a request arriving
meanwhile waits for the whole batch, and a finished request's slot stays empty.
Continuous batching (Yu et al. OSDI'22, "Orca", iteration-level scheduling): the batch is
re-formed at every step: finished requests leave, arrived ones join (while the batch has room
and the KV cache has blocks), so nobody waits for someone else's long answer.
The token budget (Agrawal et al. OSDI'24, "Sarathi-Serve", arXiv 2403.02310; vLLM's
`max_num_batched_tokens`): a step carries at most that many tokens, its decodes (one per
running request, scheduled first) and prompt tokens together. With chunked prefill (vLLM's
`enable_chunked_prefill`, on by default) a prompt is cut to what the decodes leave of the
budget, so a long prompt no longer stalls the running requests' next tokens (it is cut over
several steps); without it a prompt waits until it fits a step whole. `max_num_seqs` caps the
requests running at once. The rule is `theory.stream_sim.step_pieces`, shared with the
simulator, so both schedule the same steps.

A step runs the model once on a ragged batch (`paged_kv.ragged_forward`): each running request
contributes a piece, the tokens of its sequence (prompt + generated) not cached yet: its prompt
(or a chunk of it) when new, its last token when decoding. The pieces are concatenated into one
row of tokens for the Linears (as vLLM flattens a step's tokens), and attention runs per
request against its own keys and values read through the paged cache (`PagedKVCache`). A
piece that reaches the end of its sequence yields the request's next token: greedy, or drawn
with its temperature, top-p and seed (`paged_kv.SamplingParams`, vLLM's per-request sampling).

When the paged cache runs out of blocks mid-decode a running request is preempted (its blocks
freed, its sequence recomputed when it is re-admitted: vLLM's recompute policy), in vLLM v1's
order (`theory.stream_sim.preemption_victim`): under `scheduling_policy="fcfs"` the request
admitted last (`self.running.pop()`), under `"priority"` the running request with the largest
(priority, arrival), the lowest priority. The priority policy also admits the arrived request
of the lowest priority value first (`next_waiting`; vLLM's `--scheduling-policy priority`,
each request's `priority`, lower served first).
With the cache's prefix caching on, a request admitted starts from its longest cached prefix
(`PagedKVCache.admit`) and each step caches the blocks it filled (`commit`).
The engine works on any rank: under tensor parallelism every rank of the group runs the same
scheduler on the same stream, with one clock (rank 0's, `synced_clock`) so they agree.
"""
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch

from ..runtime.context import context
from ..theory.stream_sim import (check_budget, check_fits_budget, check_scheduling_policy,
                                  next_waiting, preemption_victim, step_pieces)
from .paged_kv import SamplingParams, check_model, next_token, ragged_forward

POLICIES = ("static", "continuous")


@dataclass
class Request:
    """One request: prompt ids (1-D), the tokens it asks for, when it arrives (seconds) and
    how it picks them (`SamplingParams`: greedy unless given a temperature; its seed makes
    its draws its own, whatever shares its steps)."""
    id: int
    prompt: torch.Tensor
    output: int
    arrival_s: float = 0.0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generated: list = field(default_factory=list)
    token_times: list = field(default_factory=list)
    cached: int = 0            # tokens of the sequence in the KV cache
    preemptions: int = 0
    priority: int = 0          # vLLM's: lower is served first under the priority policy
    _generator: torch.Generator | None = field(default=None, repr=False)

    def pick(self, logits):
        """The next token from this request's last logits row (its own generator, made on
        the first draw; generated tokens survive a preemption, so none is drawn twice)."""
        if self._generator is None and not self.sampling.greedy:
            self._generator = self.sampling.generator()
        return next_token(logits, self.sampling, self._generator)

    def sequence(self):
        return torch.cat([self.prompt, torch.tensor(self.generated, dtype=self.prompt.dtype)])

    @property
    def length(self):
        return self.prompt.numel() + len(self.generated)

    @property
    def done(self):
        return len(self.generated) >= self.output


def check_requests(requests):
    """One-line ValueError for a request the engine cannot serve as asked: an output of 0 or
    -2 tokens (it used to get 1), an empty or non-1-D prompt, an arrival that is not a finite
    number of seconds >= 0, or an id given twice (the cache keys blocks by id)."""
    seen = set()
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(f"Engine.run takes Request objects, got {type(r).__name__}")
        if isinstance(r.output, bool) or not isinstance(r.output, int) or r.output < 1:
            raise ValueError(f"request {r.id}: output must be a positive number of tokens, got "
                             f"{r.output!r}")
        if not isinstance(r.prompt, torch.Tensor) or r.prompt.ndim != 1 or r.prompt.numel() < 1:
            shape = tuple(r.prompt.shape) if isinstance(r.prompt, torch.Tensor) else \
                type(r.prompt).__name__
            raise ValueError(f"request {r.id}: prompt must be a non-empty 1-D tensor of token "
                             f"ids, got {shape}")
        if isinstance(r.arrival_s, bool) or not isinstance(r.arrival_s, (int, float)) or \
                not 0 <= r.arrival_s < float("inf"):
            raise ValueError(f"request {r.id}: arrival_s must be a finite number of seconds >= "
                             f"0, got {r.arrival_s!r}")
        if r.id in seen:
            raise ValueError(f"request id {r.id!r} is given twice; each request needs its own "
                             "id (the KV cache keys its blocks by id)")
        if isinstance(r.priority, bool) or not isinstance(r.priority, int):
            raise ValueError(f"request {r.id}: priority must be an integer (lower is served "
                             f"first), got {r.priority!r}")
        if not isinstance(r.sampling, SamplingParams):
            raise ValueError(f"request {r.id}: sampling must be a SamplingParams, got "
                             f"{type(r.sampling).__name__}")
        seen.add(r.id)


def synced_clock(group=None):
    """A clock every rank of `group` reads alike: rank 0's perf_counter, broadcast (off the
    record: it is bookkeeping, not serving traffic)."""
    ctx = context()

    def now():
        with ctx.off_the_record():
            t = torch.tensor([time.perf_counter()], dtype=torch.float64)
            return float(ctx.comm.broadcast(t, src=0, group=group, tag="clock")[0])
    return now


class Engine:
    """Serve requests on `model` with `cache` (a PagedKVCache), one ragged step at a time.

    policy: "static" or "continuous"; max_num_seqs: most requests running at once (vLLM's
    name); max_num_batched_tokens: most tokens a step carries, decodes and prompt tokens
    together (None: no cap); enable_chunked_prefill: cut a prompt to the budget left (else it
    waits to fit whole); clock / sleep: time (seconds) and waiting for the next arrival;
    on_finish(done, total): progress callback. step_time: a function [(new tokens, cached
    tokens) per request] -> seconds: time is then modelled (virtual: each step advances it by
    that much, waiting jumps to the next arrival), so the latencies are those of the modelled
    machine while the tokens are still computed here. Deprecated names: max_batch (=
    max_num_seqs) and chunk=C (= max_num_batched_tokens=C with chunked prefill: the budget now
    counts the decodes too). scheduling_policy: "fcfs" or "priority" (vLLM's; see the module
    docstring); `preempted` lists the ids preempted, in order."""

    def __init__(self, model, cache, policy="continuous", max_num_seqs=8,
                 max_num_batched_tokens=None, clock=time.perf_counter, sleep=time.sleep,
                 on_finish=None, step_time=None, *, enable_chunked_prefill=True,
                 scheduling_policy="fcfs", max_batch=None, chunk=None):
        check_model(model)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if max_batch is not None:
            warnings.warn("Engine(max_batch=) is max_num_seqs=", DeprecationWarning, 2)
            max_num_seqs = max_batch
        if chunk is not None:
            warnings.warn("Engine(chunk=C) is max_num_batched_tokens=C (decodes counted)",
                          DeprecationWarning, 2)
            if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk < 1:
                raise ValueError(f"chunk must be >= 1 token per step, got {chunk}")
            max_num_batched_tokens, enable_chunked_prefill = chunk, True
        check_budget(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        check_scheduling_policy(scheduling_policy)
        self.scheduling_policy, self.preempted = scheduling_policy, []
        self.model, self.cache, self.policy = model, cache, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.clock, self.sleep, self.on_finish = clock, sleep, on_finish
        self.step_time, self.virtual_s = step_time, 0.0
        if step_time is not None:
            self.clock, self.sleep = (lambda: self.virtual_s), self._wait_virtual
        self.steps = []     # per step: time, tokens, prefill tokens, decodes, batch, kv stats

    def _wait_virtual(self, seconds):
        self.virtual_s += seconds

    def _admit(self, waiting, running, now):
        if self.policy == "static" and running:
            return       # request-level: nobody joins a batch under way
        while len(running) < self.max_num_seqs:
            r = next_waiting(waiting, now, self.scheduling_policy)
            hit = None if r is None else self.cache.admit(r.id, r.sequence())
            if hit is None:
                break
            r.cached = hit                   # prefix caching: these tokens are not prefilled
            waiting.remove(r)
            running.append(r)

    def _pieces(self, running):
        """Decodes first (one token each), then prompt pieces, all within the token budget."""
        return step_pieces(running, self.max_num_batched_tokens, self.enable_chunked_prefill)

    def _grow(self, running, pieces):
        """Reserve blocks for each piece; preempt (the policy's victim) while the pool is
        short."""
        kept = list(pieces)
        for r, todo in pieces:
            while r in running and not self.cache.reserve(r.id, r.cached + todo):
                victim = preemption_victim(running, self.scheduling_policy)
                self.preempted.append(victim.id)
                self.cache.free(victim.id)
                victim.cached, victim.preemptions = 0, victim.preemptions + 1
                running.remove(victim)
                kept = [(q, t) for q, t in kept if q is not victim]
                self.waiting.appendleft(victim)
        return [(r, t) for r, t in kept if r in running]

    def run(self, requests):
        """Serve `requests` (arrival_s relative to the start); returns them with their
        generated tokens and token times (seconds since the start)."""
        check_requests(requests)
        for r in requests:
            if r.length + r.output - 1 > self.model.pos.num_embeddings:
                raise ValueError(f"request {r.id}: prompt {r.prompt.numel()} + output "
                                 f"{r.output} exceeds the model's {self.model.pos.num_embeddings}"
                                 " positions")
            if not self.cache.can_reserve(-1, r.prompt.numel() + r.output):
                raise ValueError(f"request {r.id} needs {r.prompt.numel() + r.output} token "
                                 "slots, more than the whole KV cache holds")
            check_fits_budget(r.id, r.prompt.numel(), r.output, self.max_num_batched_tokens,
                              self.enable_chunked_prefill)
        self.waiting = waiting = deque(sorted(requests, key=lambda r: r.arrival_s))
        running, finished, start = [], [], self.clock()
        while waiting or running:
            now = self.clock() - start
            self._admit(waiting, running, now)
            if not running:
                self.sleep(max(0.0, waiting[0].arrival_s - now))
                continue
            pieces = self._grow(running, self._pieces(running))
            logits = ragged_forward(self.model, [(r.id, r.sequence()[r.cached:r.cached + t],
                                                  r.cached) for r, t in pieces], self.cache)
            if self.step_time is not None:
                self.virtual_s += self.step_time([(t, r.cached) for r, t in pieces])
            now = self.clock() - start
            self.steps.append(dict(time_s=now, batch=len(running),
                                   tokens=sum(t for _, t in pieces),
                                   prefill_tokens=sum(t for r, t in pieces if t > 1 or
                                                      r.cached < r.prompt.numel()),
                                   kv=self.cache.stats()))
            for (r, todo), row in zip(pieces, logits):
                r.cached += todo
                if self.cache.enable_prefix_caching:
                    self.cache.commit(r.id, r.sequence()[:r.cached])
                if r.cached == r.length:       # the piece reached the end: a new token
                    r.generated.append(r.pick(row))
                    r.token_times.append(now)
            for r in [r for r in running if r.done]:
                running.remove(r)
                self.cache.free(r.id)
                finished.append(r)
                if self.on_finish is not None:
                    self.on_finish(len(finished), len(requests))
        return sorted(finished, key=lambda r: r.id)
