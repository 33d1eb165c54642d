"""The batch-invariance measure (parallel/paged_kv.batch_logits, batch_logit_gap, `run serve`'s
report): how far a request's logits move when it shares a ragged pass with others."""
import torch
from torch import nn

from labkit.models import build
from labkit.parallel.paged_kv import batch_logit_gap, batch_logits

SEQS = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
        for n in (9, 14, 5)]


def test_alone_and_batched_agree_to_rounding():
    gpt = build("gpt", seed=0, seq=48, layers=2).eval()
    together, alone = batch_logits(gpt, SEQS)
    assert together.shape == alone.shape == (len(SEQS), gpt.head.out_features)
    gap = batch_logit_gap(gpt, SEQS)
    assert gap == (together - alone).abs().max().item()
    # float32 sums in another order: at most ~ layers x K x eps x |logit| = 2 x 512 x 6e-8
    # x ~1 = 6e-5 (K: the widest inner product, the MLP's 4 x 128)
    assert 0 <= gap < 1e-4
    assert torch.equal(together.argmax(-1), alone.argmax(-1))


class LeaksAcrossRequests(nn.Module):
    """A row-wise layer that is not: it subtracts the mean over every token of the pass."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x) - x.mean(dim=1, keepdim=True)


def test_a_layer_that_mixes_requests_shows_in_the_gap():
    gpt = build("gpt", seed=0, seq=48, layers=2).eval()
    gpt.blocks[0].mlp = LeaksAcrossRequests(gpt.blocks[0].mlp)
    assert batch_logit_gap(gpt, SEQS) > 1e-2
