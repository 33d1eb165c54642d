"""MasterWeights: mixed-precision training's fp32 master copy, for any optimizer.

The model computes in a 16-bit dtype (bf16: 2 bytes per weight and gradient); the optimizer
steps fp32 copies of the weights (the masters), so that updates smaller than a bf16 ulp still
add up, and the result is rounded back into the 16-bit weights (Micikevicius et al. 2018,
"Mixed Precision Training", arXiv 1710.03740). Bytes per parameter with Adam: 2 (weights) +
2 (gradients) + 4 (master) + 8 (moments) = 16, the ZeRO paper's 2 + 2 + K with K = 12.

    optimizer = MasterWeights(model.parameters(), inner=torch.optim.Adam, lr=1e-3)
    ShardedOptimizer(params, MasterWeights, stage=2, inner=torch.optim.Adam, lr=1e-3)

Inside `ShardedOptimizer` it is handed this rank's tensors (stage 1: whole parameters;
stage 2: slices of the flat buckets), so the masters are sharded with the optimizer state:
K Psi / N bytes per rank. `masters` lists them (in the order of the tensors it steps),
`load_masters` sets them (e.g. to the unrounded fp32 weights, from
`ShardedOptimizer.local_part`), and `ShardedOptimizer.gather_full(masters)` puts them together.
Under `fully_shard` no MasterWeights is needed: its `MixedPrecisionPolicy(param_dtype=...)`
(fsdp2.py, torch's) keeps the shards in fp32 and computes with 16-bit copies gathered from them.
"""
import torch


class MasterWeights(torch.optim.Optimizer):
    """`inner` (Adam, SGD...) on fp32 copies of the low-precision tensors it is handed: the
    gradients are cast up, the step runs in fp32, the result is rounded back."""

    def __init__(self, params, inner=torch.optim.Adam, **defaults):
        self._state = {}
        super().__init__(params, defaults)
        self.inner = inner([dict(g, params=[p.detach().float().clone() for p in g["params"]])
                            for g in self.param_groups], **defaults)

    @property
    def masters(self):
        """The fp32 masters, one per tensor it steps, in param-group order."""
        return [m for group in self.inner.param_groups for m in group["params"]]

    @torch.no_grad()
    def load_masters(self, values):
        """Set the masters (one value per tensor, as `masters`): e.g. the unrounded fp32
        weights the low-precision ones were rounded from."""
        values = list(values)
        if len(values) != len(self.masters):
            raise ValueError(f"load_masters: {len(values)} values for {len(self.masters)} "
                             "masters")
        for m, value in zip(self.masters, values):
            m.copy_(value)

    @property
    def state(self):   # what memory tracking sees: the masters and the inner optimizer's state
        if "inner" not in self.__dict__:
            return self._state
        return {m: dict(self.inner.state.get(m, {}), master=m) for m in self.masters}

    @state.setter
    def state(self, value):
        self._state = value

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in group.items() if k != "params"})
            for p, m in zip(group["params"], inner["params"]):
                m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            for p, m in zip(group["params"], inner["params"]):
                p.copy_(m)
                m.grad = None
        return loss
