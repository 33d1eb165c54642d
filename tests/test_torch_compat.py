"""runtime/torch_compat.py, the one place labkit touches torch's private API: on this torch every
private name is found (the fast paths run); each guard, with its private name taken away, falls
back and still gives the right answer (FLOPs as FlopCounterMode counts them, the same memory
peak, data-parallel gradients equal to one device's, ZB-H1's gradients equal to one device's)
or says in one line what is lost."""
import importlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import labkit
from labkit import numerics
from labkit.runs import reference
from labkit.runtime import flops, torch_compat
from labkit.runtime.memory import MemoryTracker

# Each guard's private name: (module, attribute path) as torch_compat looks it up.
PRIVATE = {
    "_DISPATCH_MODE": ("torch.utils._python_dispatch", "TorchDispatchMode"),
    "_CURRENT_MODE": ("torch.utils._python_dispatch", "_get_current_dispatch_mode"),
    "_HIGHER_ORDER": ("torch._ops", "HigherOrderOperator"),
    "_HAS_KERNEL": ("torch._C", "_dispatch_has_kernel_for_dispatch_key"),
    "_CURRENT_NODE": ("torch._C", "_current_autograd_node"),
    "_ENGINE": ("torch.autograd", "Variable._execution_engine"),
}


@pytest.fixture
def compat(monkeypatch):
    """torch_compat, with `compat.lose(name)` to take one private name away (as a torch without
    it would: the guard's lookup answers None); restored, and the counters' caches emptied."""
    def lose(name):
        monkeypatch.setattr(torch_compat, name, None)
        monkeypatch.setattr(torch_compat, "_SAID", set())   # each test hears the warning
    torch_compat.lose = lose
    _forget_flop_caches()
    yield torch_compat
    del torch_compat.lose
    monkeypatch.undo()
    _forget_flop_caches()


def _forget_flop_caches():
    for cache in (flops._PLAIN, flops._FORMULAS, flops._COUNTS):
        cache.clear()


def test_this_torch_has_every_private_name_so_the_fast_paths_run():
    for name in PRIVATE:
        assert getattr(torch_compat, name) is not None, name
    assert None not in torch_compat.pipelining_backward()
    assert torch_compat.optimizer_global_hooks() is not None


@pytest.mark.parametrize("name", list(PRIVATE))
def test_a_missing_private_name_is_looked_up_as_none(monkeypatch, name):
    module, path = PRIVATE[name]
    *owner_path, attribute = path.split(".")
    owner = importlib.import_module(module)
    for part in owner_path:
        owner = getattr(owner, part)
    found = getattr(owner, attribute)
    monkeypatch.delattr(owner, attribute)
    try:
        assert torch_compat._lookup(module, *path.split(".")) is None
    finally:
        monkeypatch.undo()
    assert torch_compat._lookup(module, *path.split(".")) is found
    assert torch_compat._lookup("torch.no_such_module", "x") is None


# --- FLOPs -------------------------------------------------------------------------------------

def _flop_cases():
    torch.manual_seed(0)
    a, b = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
    x3 = torch.randn(2, 8, 16, requires_grad=True)
    lin, conv = nn.Linear(16, 5), nn.Conv2d(3, 6, 3, stride=2, padding=1)
    img = torch.randn(2, 3, 9, 9, requires_grad=True)
    norm = nn.LayerNorm(16)
    return dict(
        mm=lambda: (a @ b).sum().backward(),
        linear_3d=lambda: lin(x3).sum().backward(),          # linear decomposes to matmuls
        conv=lambda: conv(img).sum().backward(),
        norm_then_linear=lambda: lin(F.gelu(norm(x3))).sum().backward())


def _counted(run):
    counter = flops.start_counting()
    try:
        run()
    finally:
        flops.stop_counting(counter)
    return counter


@pytest.mark.parametrize("lost", ["_DISPATCH_MODE", "_HAS_KERNEL", "_HIGHER_ORDER",
                                  "_CURRENT_MODE"])
@pytest.mark.parametrize("case", list(_flop_cases()))
def test_flops_without_a_private_name_are_still_flop_counter_modes(compat, lost, case):
    run = _flop_cases()[case]
    with FlopCounterMode(display=False) as reference_count:
        run()
    expected = reference_count.get_total_flops()
    assert expected > 0
    compat.lose(lost)
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        counter = _counted(run)
    assert counter.flops == expected
    public = isinstance(counter, flops._PublicCounter)
    assert public == (lost == "_DISPATCH_MODE")            # only that one changes counter
    assert any("FlopCounterMode" in str(w.message) for w in heard) == public


def test_the_public_counter_keeps_the_cpu_attention_formulas(compat):
    b, h, s, d = 2, 4, 8, 16
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = torch.randn(b, h, 2 * s, d), torch.randn(b, h, 2 * s, d)
    matmul = 2 * b * h * s * (2 * s) * d      # Q K^T or P V, 2 b h s s' d FLOPs each
    compat.lose("_DISPATCH_MODE")
    with pytest.warns(RuntimeWarning, match="FlopCounterMode"):
        counter = flops.start_counting()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, 2 * s).bool())
    forward = counter.flops
    out.sum().backward()
    flops.stop_counting(counter)
    assert (forward, counter.flops) == (2 * matmul, 7 * matmul)


@pytest.mark.parametrize("lost", ["_CURRENT_MODE", "_DISPATCH_MODE", "hooks"])
def test_an_optimizer_step_counts_the_same_without_the_private_names(compat, monkeypatch, lost):
    model = nn.Linear(8, 8)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)

    def closure():   # forward inside the step: its FLOPs count; Adam's own count 0
        loss = model(torch.randn(4, 8)).sum()
        loss.backward()
        return loss
    with FlopCounterMode(display=False) as reference_count:
        optimizer.step(closure)
    if lost == "hooks":
        monkeypatch.setattr(torch_compat, "optimizer_global_hooks", lambda: None)
    else:
        compat.lose(lost)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, with_closure = _counted(optimizer.step), _counted(lambda: optimizer.step(closure))
    assert plain.flops == 0
    assert with_closure.flops == reference_count.get_total_flops() > 0


def test_higher_order_ops_are_told_apart_without_torchs_class(compat):
    ops = [torch.ops.higher_order.cond, torch.ops.aten.mm.default, torch.ops.aten.add.Tensor]
    with_class = [compat.is_higher_order_op(op) for op in ops]
    compat.lose("_HIGHER_ORDER")
    assert [compat.is_higher_order_op(op) for op in ops] == with_class == [True, False, False]


def test_composite_kernels_are_unknown_not_wrong_without_the_dispatch_key(compat):
    linear, mm = torch.ops.aten.linear.default, torch.ops.aten.mm.default
    assert (compat.has_composite_implicit(linear), compat.has_composite_implicit(mm)) == \
        (True, False)
    compat.lose("_HAS_KERNEL")
    assert compat.has_composite_implicit(linear) is None    # "try decompose"


# --- memory ------------------------------------------------------------------------------------

def _tracked_peak():
    cfg = reference.RunConfig(model_kwargs=dict(layers=2))
    model = reference.build_model(cfg)
    optimizer = reference.build_optimizer(model.parameters(), cfg)
    tracker = MemoryTracker().watch(model=model, optimizer=optimizer)
    for p in list(model.parameters())[::3]:   # gradients that leave in backward (ZeRO-2-like)
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    for step in range(2):
        x, y = reference.batch(model, cfg, step)
        optimizer.zero_grad(set_to_none=True)
        with tracker.track_activations():
            for mx, my in zip(x.chunk(2), y.chunk(2)):
                model(mx, my).backward()
        optimizer.step()
        tracker.sample(f"after step {step}")
    return tracker.report()


def test_the_memory_peak_is_the_same_without_the_current_autograd_node(compat):
    with_node = _tracked_peak()
    compat.lose("_CURRENT_NODE")
    assert compat.current_autograd_node() != compat.current_autograd_node()   # never "same"
    assert _tracked_peak() == with_node


# --- the end of backward -----------------------------------------------------------------------

def _backward_with_callback():
    ran, queued = [], []
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum()
    y.grad_fn.register_hook(lambda *_: queued.append(
        torch_compat.queue_callback(lambda: ran.append(x.grad is not None))))
    y.backward()
    return queued, ran


def test_queue_callback_runs_at_the_end_of_backward_or_says_it_cannot(compat):
    assert _backward_with_callback() == ([True], [True])    # after x.grad was written
    compat.lose("_ENGINE")
    with pytest.warns(RuntimeWarning, match="finish_gradient_synchronization"):
        assert _backward_with_callback() == ([False], [])


def _data_parallel_without_the_callback(ctx):
    from labkit.runtime import torch_compat as rank_compat
    rank_compat._ENGINE = None                   # this rank's torch has no engine callback
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    single, exact = [nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
                     for dtype in (torch.float32, torch.float64)]
    single.load_state_dict(model.state_dict())
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    x = torch.randn(4 * ctx.world_size, 6, generator=torch.Generator().manual_seed(1))
    wrapped = labkit.DataParallel(model)
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        F.mse_loss(wrapped(x.chunk(ctx.world_size)[ctx.rank]), torch.zeros(4, 3)).backward()
    wrapped.finish_gradient_synchronization()    # what the warning asks for
    F.mse_loss(single(x), torch.zeros(len(x), 3)).backward()
    F.mse_loss(exact(x.double()), torch.zeros(len(x), 3, dtype=torch.float64)).backward()
    grads = [{n: q.grad for n, q in m.named_parameters()} for m in (model, single, exact)]
    return numerics.compare(*grads), [str(w.message) for w in heard]


def test_data_parallel_without_the_callback_is_right_after_finishing_by_hand():
    for agreement, heard in labkit.launch(_data_parallel_without_the_callback, 2, timeout_s=300):
        assert agreement.ok, str(agreement)
        assert any("finish_gradient_synchronization" in m for m in heard), heard


# --- pipelining --------------------------------------------------------------------------------

def test_pipelining_backward_is_none_without_torchs_split(monkeypatch):
    backward = importlib.import_module("torch.distributed.pipelining._backward")
    monkeypatch.delattr(backward, "stage_backward_weight")
    assert torch_compat.pipelining_backward() == (None, None)


def _zero_bubble_without_torchs_split(ctx):
    from test_zero_bubble import _grad_agreement

    from labkit.parallel import zero_bubble
    zero_bubble.stage_backward_input = zero_bubble.stage_backward_weight = None
    return _grad_agreement(ctx, "mlp")


def test_zero_bubble_without_torchs_split_equals_one_device():
    results = labkit.launch(_zero_bubble_without_torchs_split, 2, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["grads"].ok, (rank, str(r["grads"]))
        assert all(r["frozen"])
    assert results[-1]["loss"].ok, str(results[-1]["loss"])


def test_torchs_order_is_read_or_refused_in_one_line(monkeypatch):
    from torch.distributed.pipelining import schedules as torch_schedules

    from labkit.parallel import zero_bubble
    kind = torch_schedules.ScheduleZBVZeroBubble
    actions = zero_bubble.torch_actions("ScheduleZBVZeroBubble", 2, 4)
    kinds = [a.computation_type.value for a in actions[0]]
    assert len(actions) == 2 and kinds.count("F") == 2 * 4        # 2 chunks x M forwards

    def reads_another_field(self, rank):
        return self._some_field_torch_renamed
    monkeypatch.setattr(kind, "_calculate_single_rank_operations", reads_another_field)
    assert torch_compat.pipeline_actions(kind, 2, 4) is None
    monkeypatch.delattr(kind, "_calculate_single_rank_operations")
    with pytest.raises(RuntimeError, match=r"^[^\n]*no ScheduleZBVZeroBubble order[^\n]*$"):
        zero_bubble.torch_order("ScheduleZBVZeroBubble", 2, 4)
    with pytest.warns(RuntimeWarning, match="ScheduleZBVZeroBubble left out"):   # lesson 02
        assert zero_bubble.readable_torch_orders() == ["ScheduleDualPipeV"]
    monkeypatch.undo()
    assert zero_bubble.readable_torch_orders() == list(zero_bubble.TORCH_V_SCHEDULES)
