"""Context parallelism for a whole causal language model: what each rank feeds it, and its loss.

`ContextParallel` makes the attention see the whole sequence; the rest of a language model's
step has to be told that each rank holds a shard. Sharding input_ids and labels and calling a
transformers model as usual is wrong three ways, silently:
  1. positions: the model numbers each shard's tokens 0..s/N-1 (rotary or learned positions);
  2. labels: the model shifts the labels by one *inside* the shard, so the token at each
     shard's end is trained on nothing and the one after it is lost;
  3. the loss: each rank's mean over its own labelled tokens; with ignored labels (-100) the
     shards hold different counts, and the mean of the ranks' means is not the batch's mean.
`context_parallel_batch` fixes all three: position_ids are the global positions of this rank's
tokens (`sequence_positions` of the layout), the labels are shifted on the whole sequence
(target[t] = labels[t+1], the last one ignored) *before* sharding, and `loss(logits)` is
    sum over this rank's labelled tokens of CE / (labelled tokens in the whole batch) x N,
so that the replicated weights' gradients, averaged over the group as for any replicated
weight (DataParallel, average_gradients), are those of the batch's mean loss; its value is
that mean (one all_reduce of a scalar, off the record: reporting, not training traffic).

    model = ContextParallel(hf_model, group, layout="zigzag")
    batch = context_parallel_batch(input_ids, labels, group, layout="zigzag")
    loss = batch.loss(model(**batch.inputs).logits)        # no labels= to the model
    loss.backward(); average_gradients(model.parameters(), group)
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime.comm import GroupLike
from ..runtime.context import context
from .ring_attention import sequence_positions, shard_sequence

IGNORE_INDEX = -100   # transformers' (and F.cross_entropy's) label for "no loss here"


@dataclass
class ContextParallelBatch:
    """This rank's shard of a language-model batch (see the module docstring)."""
    input_ids: torch.Tensor      # (b, s/N) this rank's tokens
    position_ids: torch.Tensor   # (b, s/N) their global positions
    targets: torch.Tensor        # (b, s/N) next-token labels, shifted before sharding
    labelled: int                # labelled tokens in the whole batch (all ranks)
    group: object
    ignore_index: int = IGNORE_INDEX

    @property
    def inputs(self):
        """The model's keyword arguments (no attention_mask: the cores apply the causal mask)."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids)

    def loss(self, logits):
        """The batch's mean next-token loss (value); gradient scaled for averaging."""
        if logits.shape[:2] != self.targets.shape:
            raise ValueError(f"logits {tuple(logits.shape)} do not match this rank's "
                             f"{tuple(self.targets.shape)} tokens: pass the model's logits")
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                self.targets.reshape(-1), ignore_index=self.ignore_index,
                                reduction="sum")
        term = total * self.group.size / max(self.labelled, 1)
        ctx = context()
        with ctx.off_the_record():
            mean = ctx.comm.all_reduce(term.detach().clone(), op="avg", group=self.group,
                                       tag="context parallel loss")
        return term + (mean - term.detach())


CAUSAL_SDPA = "labkit_causal_sdpa"


def causal_sdpa():
    """The name of an attention implementation for transformers' `attn_implementation=`:
    its SDPA, with a mask function that builds no mask, so every layer calls SDPA with
    is_causal=True (right without padding: context-parallel batches have none). Registered
    on first call."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, lambda *args, **kwargs: None)
    return CAUSAL_SDPA


def refuse_sequence_mixers(module):
    """ContextParallel's one-line refusal of a layer that mixes tokens outside attention: a
    Conv1d sliding over the sequence (Mamba's and gated-delta-net's conv, a short conv) would
    see only this rank's shard, silently wrong; only attention is made context-parallel."""
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1:
            raise ValueError(f"ContextParallel: {type(m).__name__} {name or 'the module'} "
                             f"(kernel {m.kernel_size[0]}) convolves along the sequence (a Mamba"
                             ", linear-attention or short-conv mixer), which would see only this "
                             "rank's shard: only attention runs context-parallel here")


def attn_mask_refusal(mask):
    """ContextParallel's one-line refusal of an SDPA call with `mask` (b|1, h|1, q, k), naming
    what the mask holds: the plain causal mask of the shard (a model that always builds one),
    a position bias (ALiBi), or padding / packed sequences."""
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    q, k = mask.shape[-2:]
    causal = torch.ones(q, k, dtype=torch.bool, device=mask.device).tril(k - q)
    biased = mask.dtype != torch.bool and bool(mask.masked_select(allowed).ne(0).any())
    if biased:
        return ("ContextParallel: scaled_dot_product_attention got an attn_mask holding a "
                "position bias (ALiBi, added to the mask by the model), which the cores do not "
                "add: a model with ALiBi cannot run context-parallel here")
    if bool((allowed == causal).all()):
        return ("ContextParallel: the model built its own causal attn_mask of this rank's "
                "tokens (it materialises one on every call, as Falcon does), which the cores "
                "cannot take: build it with attn_implementation=causal_sdpa() (from "
                "labkit.parallel.context_batch: SDPA's is_causal, no mask)")
    return (f"ContextParallel: scaled_dot_product_attention got a {mask.dim()}-D attn_mask "
            "that is not the causal one (padding, or packed sequences: position_ids that "
            "jump with use_cache=False); the cores apply only the causal mask of the layout: "
            "pass no attention_mask and keep use_cache on, see context_parallel_batch")


def shift_labels(labels, ignore_index=IGNORE_INDEX):
    """target[t] = labels[t+1] on the whole sequence, the last position ignored."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], 1)


def context_parallel_batch(input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                           group: GroupLike = None, layout: str = "contiguous",
                           ignore_index: int = IGNORE_INDEX) -> ContextParallelBatch:
    """This rank's ids, global position ids and next-token targets of the whole (b, s) batch
    (the same on every rank); labels None: the ids themselves (language modelling)."""
    group = context().group(group)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got {tuple(input_ids.shape)}")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must match input_ids "
                         f"{tuple(input_ids.shape)}")
    targets = shift_labels(labels, ignore_index)
    positions = sequence_positions(input_ids.shape[1], group.rank, group.size, layout,
                                   input_ids.device)
    return ContextParallelBatch(
        input_ids=shard_sequence(input_ids, group, layout, dim=1),
        position_ids=positions.unsqueeze(0).expand(input_ids.shape[0], -1),
        targets=shard_sequence(targets, group, layout, dim=1),
        labelled=int((targets != ignore_index).sum()), group=group, ignore_index=ignore_index)
