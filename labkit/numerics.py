"""When does a parallel run "equal one device"? A tolerance that follows from the arithmetic.

A parallel run adds the same numbers in another order, so in float32 it cannot match the
single-device run bit for bit, and how far apart the two land depends on the CPU's kernels
(AVX-512, AVX2 and plain code round differently). A fixed tolerance (1e-6) that holds on one
machine fails on another. The rule here asks instead how far float32 itself is from the exact
answer: run the single-device reference in float64 as well (the "exact" run, ~1e-16 relative)
and compare both float32 runs with it.

    error      = rms(parallel - exact)          (relative for losses: / |exact|)
    own_error  = rms(single float32 - exact)    (the rounding float32 makes on one device)
    pass  when   error <= FACTOR * own_error + ULPS * eps(float32) * scale

`scale` is rms(exact) (1 for relative errors): the floor is a few units in the last place of
the values compared, for runs so short that float32 happens to be nearly exact. A parallel run
whose error is a few times float32's own differs by rounding only; a real bug (a missed
all-reduce, a wrong shard) is off by the size of a gradient step, orders above.

Why the root mean square over every value, not the largest difference: each run's rounding is
a random draw, and the largest of thousands of draws is a heavy-tailed number. An element whose
gradient nearly cancels has a large relative error, which Adam's step turns into an update
error up to lr; which elements those are differs between the two runs. An MLP trained 3 steps
with AdamW, 2 ranks x 2 micro-batches against one device, 200 seeds: the ratio of the largest
differences (parallel / float32's own) reached 10.9 (95th percentile 3.2), the ratio of the
rms 3.0 (95th percentile 1.7). A one-sample max against FACTOR = 4 flipped on an AVX-512 CPU;
the rms is an average of many roundings and stays put. Its price: a wrong value in one element
of n is diluted by sqrt(n) (one parameter of 10,000 off by 1e-3 still fails, by 10x); the bugs
these checks look for (a missed all-reduce, a wrong shard) move whole tensors.

Adam needs care: a gradient whose exact value is 0 (an attention key bias: softmax ignores a
shift of a whole row of scores) is computed as rounding noise, and Adam's step
lr * m / (sqrt(v) + eps) turns noise well above eps into steps of up to lr. The float32
reference has such noise too, so `own_error` carries it, and the rule still holds.

    ok = compare(parallel_params, single_params, float64_params)
    print(ok)   # rms error 3.1e-08, float32's own 1.2e-08 (limit 6.1e-08): within rounding
"""
import copy
from dataclasses import dataclass

import torch

FACTOR = 4.0   # the parallel run may round a few times worse than one device (other sum order)
ULPS = 4       # the floor: a few float32 units in the last place of the values' scale
EPS32 = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class Agreement:
    """The verdict and the numbers behind it (truthy when within rounding)."""
    error: float       # the parallel run's distance (rms) to the float64 run
    own_error: float   # the single-device float32 run's distance (rms) to it
    limit: float       # FACTOR * own_error + the floor
    relative: bool = False

    @property
    def ok(self):
        return self.error <= self.limit

    def __bool__(self):
        return self.ok

    def __str__(self):
        kind = "rms relative error" if self.relative else "rms error"
        verdict = "within rounding" if self.ok else "NOT within rounding"
        return (f"{kind} {self.error:.1e}, float32's own {self.own_error:.1e} "
                f"(limit {self.limit:.1e}): {verdict}")


def compare(parallel, single, exact, *, relative=False, factor=FACTOR, ulps=ULPS):
    """Agreement of `parallel` with one device, judged by float32's own error (module doc).

    Each argument is a tensor, a {name: tensor} dict (parameters; the same names in each) or a
    sequence of numbers (losses). `relative=True` divides each error by |exact| (losses).
    """
    p, s, e = (_flat(v, names=_names(exact)) for v in (parallel, single, exact))
    if not (p.shape == s.shape == e.shape):
        raise ValueError(f"shapes differ: parallel {tuple(p.shape)}, single {tuple(s.shape)}, "
                         f"exact {tuple(e.shape)}")
    if not e.numel():
        return Agreement(0.0, 0.0, 0.0, relative)
    scale = 1.0 if relative else _rms(e)
    divide = e.abs().clamp_min(torch.finfo(torch.float64).tiny) if relative else 1.0
    error, own = _rms((p - e) / divide), _rms((s - e) / divide)
    return Agreement(error, own, factor * own + ulps * EPS32 * scale, relative)


def _rms(values):
    return values.square().mean().sqrt().item()


def compare_loss(parallel, single, exact, **kwargs):
    """`compare` on loss curves, relative: a loss of 4.1 and one of 0.3 round alike."""
    return compare(parallel, single, exact, relative=True, **kwargs)


def _names(value):
    return list(value) if isinstance(value, dict) else None


def _flat(value, names=None):
    """All values as one float64 vector (a dict in the exact run's name order)."""
    if isinstance(value, dict):
        if names is not None and set(value) != set(names):
            raise KeyError(f"parameter names differ: {sorted(set(value) ^ set(names))[:5]}")
        parts = [value[k] for k in (names or value)]
        return torch.cat([t.detach().reshape(-1).double() for t in parts]) if parts \
            else torch.zeros(0, dtype=torch.float64)
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).double()
    return torch.tensor([float(v) for v in value], dtype=torch.float64)


def exact_copy(module):
    """A float64 copy of `module` (the same initial weights) to train beside the float32 one."""
    return copy.deepcopy(module).double()


def cast(value, dtype):
    """Floating tensors in `value` (a tensor, or nested tuples/lists) in `dtype`; others kept."""
    if isinstance(value, (tuple, list)):
        return type(value)(cast(v, dtype) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def dtype_of(module):
    """The dtype of `module`'s first floating parameter (float32 if it has none)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
