"""The one Trainer (labkit/runs/trainer.py): gradient accumulation over K micro-batches trains as
the full batch does (labkit.numerics, against the float64 run), the hooks run where the
technique's collectives go, and a bad `accumulate` is refused in one line naming it."""
import pytest
import torch

from labkit import numerics
from labkit.runs.reference import RunConfig, batch, build_model, build_optimizer, full_params
from labkit.runs.trainer import Optimizers, Trainer

CFG = RunConfig(steps=2, optimizer="sgd", lr=0.1)


def run(accumulate=1, dtype=torch.float32, **hooks):
    model = build_model(CFG).to(dtype)
    trainer = Trainer(None, CFG, model, optimizer=build_optimizer,
                      batch=lambda step: batch(model, CFG, step, dtype), accumulate=accumulate,
                      **hooks).fit()
    return dict(loss=trainer.losses, params=full_params(model))


def test_accumulation_equals_the_full_batch():
    whole, exact = run(1), run(1, torch.float64)
    for k in (2, 4):
        micro = run(k)
        assert numerics.compare_loss(micro["loss"], whole["loss"], exact["loss"]).ok, k
        assert numerics.compare(micro["params"], whole["params"], exact["params"]).ok, k


def test_hooks_run_between_backward_and_the_step():
    """after_backward sees this step's gradients and the weights before the update;
    after_step(step) runs once per step, after the update; reduce_loss's value is recorded."""
    seen = []
    model = build_model(CFG)
    first = next(model.parameters())

    def after_backward():
        seen.append(("backward", first.grad is not None, first.detach().clone()))

    def after_step(step):
        seen.append(("step", step, first.detach().clone()))
    trainer = Trainer(None, CFG, model, optimizer=build_optimizer,
                      batch=lambda step: batch(model, CFG, step),
                      after_backward=after_backward, after_step=after_step,
                      reduce_loss=lambda loss: -loss.item()).fit()
    assert [s[0] for s in seen] == ["backward", "step"] * CFG.steps
    assert [s[1] for s in seen] == [True, 0, True, 1]
    assert not torch.equal(seen[0][2], seen[1][2])      # the step changed the weights
    assert all(value < 0 for value in trainer.losses)


@pytest.mark.parametrize("accumulate", [0, -1, 1.5])
def test_bad_accumulate_is_refused_in_one_line(accumulate):
    with pytest.raises(ValueError, match="accumulate"):
        Trainer(None, CFG, build_model(CFG), optimizer=build_optimizer, batch=batch,
                accumulate=accumulate)


def test_a_forward_backward_hook_replaces_forward_and_backward():
    """The hook (a pipeline's schedule) runs once per step in place of the trainer's own
    forward and backward, and trains as they do: the same operations, the same numbers."""
    model, calls = build_model(CFG), []

    def forward_backward(x, y):
        calls.append(x.shape)
        loss = model(x, y)
        loss.backward()
        return loss
    hooked = Trainer(None, CFG, model, optimizer=build_optimizer,
                     batch=lambda step: batch(model, CFG, step),
                     forward_backward=forward_backward).fit()
    plain = run()
    assert len(calls) == CFG.steps
    assert hooked.losses == plain["loss"]
    assert all(torch.equal(p, plain["params"][k]) for k, p in full_params(model).items())


def test_optimizers_step_as_one_optimizer_over_all_the_parameters():
    """`Optimizers` (one optimizer per gradient group, the mesh's dense and expert weights)
    steps every parameter as one Adam over all of them would; its state is all of theirs."""
    cfg = RunConfig(steps=2)   # Adam: a state per parameter

    def train(split):
        model = build_model(cfg)
        params = list(model.parameters())
        optimizer = (Optimizers([build_optimizer(params[:split], cfg),
                                 build_optimizer(params[split:], cfg)])
                     if split else build_optimizer(params, cfg))
        Trainer(None, cfg, model, optimizer=optimizer,
                batch=lambda step: batch(model, cfg, step)).fit()
        return full_params(model), optimizer, len(params)
    (params, both, count), (one, _, _) = train(3), train(0)
    assert all(torch.equal(p, one[k]) for k, p in params.items())
    assert len(both.state) == count == sum(len(o.state) for o in both.optimizers)


def test_a_forward_backward_hook_with_accumulation_is_refused_in_one_line():
    with pytest.raises(ValueError, match="forward_backward hook"):
        Trainer(None, CFG, build_model(CFG), optimizer=build_optimizer, batch=batch,
                forward_backward=lambda x, y: None, accumulate=2)
