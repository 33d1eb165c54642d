"""The one Trainer (labkit/runs/trainer.py): gradient accumulation over K micro-batches trains as
the full batch does (labkit.numerics, against the float64 run), the hooks run where the
technique's collectives go, and a bad `accumulate` is refused in one line naming it."""
import pytest
import torch

from labkit import numerics
from labkit.runs.reference import RunConfig, batch, build_model, build_optimizer, full_params
from labkit.runs.trainer import Trainer

CFG = RunConfig(steps=2, optimizer="sgd", lr=0.1)


def run(accumulate=1, dtype=torch.float32, **hooks):
    model = build_model(CFG).to(dtype)
    trainer = Trainer(None, CFG, model, optimizer=build_optimizer, batch=batch, dtype=dtype,
                      accumulate=accumulate, **hooks).fit()
    return dict(loss=trainer.losses, params=full_params(model))


def test_accumulation_equals_the_full_batch():
    whole, exact = run(1), run(1, torch.float64)
    for k in (2, 4):
        micro = run(k)
        assert numerics.compare_loss(micro["loss"], whole["loss"], exact["loss"]).ok, k
        assert numerics.compare(micro["params"], whole["params"], exact["params"]).ok, k


def test_hooks_run_between_backward_and_the_step():
    """after_backward sees this step's gradients and the weights before the update;
    after_step(step) runs once per step, after the update; record_loss keeps what it returns."""
    seen = []
    model = build_model(CFG)
    first = next(model.parameters())

    def after_backward():
        seen.append(("backward", first.grad is not None, first.detach().clone()))

    def after_step(step):
        seen.append(("step", step, first.detach().clone()))
    trainer = Trainer(None, CFG, model, optimizer=build_optimizer, batch=batch,
                      after_backward=after_backward, after_step=after_step,
                      record_loss=lambda loss: -loss.item()).fit()
    assert [s[0] for s in seen] == ["backward", "step"] * CFG.steps
    assert [s[1] for s in seen] == [True, 0, True, 1]
    assert not torch.equal(seen[0][2], seen[1][2])      # the step changed the weights
    assert all(value < 0 for value in trainer.losses)


@pytest.mark.parametrize("accumulate", [0, -1, 1.5])
def test_bad_accumulate_is_refused_in_one_line(accumulate):
    with pytest.raises(ValueError, match="accumulate"):
        Trainer(None, CFG, build_model(CFG), optimizer=build_optimizer, batch=batch,
                accumulate=accumulate)
