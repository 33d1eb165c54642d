"""One time model: the same step, priced by every caller, is one number (issue 43).

Lesson 09's serving planner (serving.serving_time, `plan --serve`), lesson 10's request-stream
price (serving_stream.modelled_step_s) and the stream simulator behind `plan --serve --rate`
(stream_sim.simulate) all time a serving pass through pricing.serving_pass; the training
planner and the recompute choices share kernels.training_forward (pricing.training_layer)."""
import pytest

from labkit.theory import (catalog, hardware, kernels, planner, pricing, serving,
                           serving_stream, stream_sim)

LLAMA, H100 = catalog.model("llama-3-8b"), hardware.gpu("H100")
PROMPT = 1024


def _simulated(batch, prompt):
    """(first token, second token) seconds of `batch` requests of `prompt` tokens and 2
    outputs, all arriving at 0, on the simulator with modelled_step_s as its clock."""
    step = lambda pieces: serving_stream.modelled_step_s(LLAMA, H100, pieces)  # noqa: E731
    stream = [dict(id=i, prompt=prompt, output=2, arrival_s=0.0) for i in range(batch)]
    done = stream_sim.simulate(stream, step, "continuous", batch)   # at most `batch` running
    first, second = done[0].token_times
    return first, second - first


@pytest.mark.parametrize("batch", [1, 64])
def test_a_decode_and_a_prefill_step_are_one_number_through_every_caller(batch):
    # serving_time's TPOT with 2 new tokens decodes at context P + 1 (P + T/2) over P + 2
    # keys: the simulator's second token of a P + 1 prompt reads the same P + 2
    planned = serving.serving_time(LLAMA, gpu="H100", batch=batch, prompt_len=PROMPT,
                                   new_tokens=2)
    step = serving_stream.modelled_step_s(LLAMA, H100, [(1, PROMPT + 1)] * batch)
    first, _ = _simulated(batch, PROMPT)
    _, decode = _simulated(batch, PROMPT + 1)
    assert planned["tpot_s"] == pytest.approx(step, rel=1e-12)
    assert decode == pytest.approx(step, rel=1e-12)
    assert planned["ttft_s"] == pytest.approx(first, rel=1e-12)
    # and the price is the kernel model's: the weights and cache at the sustained bandwidth
    # (memory-bound at both batches) plus a launch per kernel (11 per layer, 2 for the head)
    part = pricing.serving_pass(LLAMA, H100, [(1, PROMPT + 1)] * batch)
    assert part["memory"] > part["compute"]
    read = pricing.weight_split(LLAMA)[0] + batch * (PROMPT + 2) * \
        pricing.kv_bytes_per_token(LLAMA)
    assert step == pytest.approx(read / kernels.hbm_bandwidth(H100)
                                 + (32 * 11 + 2) * kernels.LAUNCH_S, rel=1e-9)


def test_a_ragged_step_prices_each_pieces_attention_at_its_own_length():
    """A prefill beside decodes: its attention over its own prompt, not the batch's mean."""
    prefill, decodes = [(2048, 0)], [(1, 100)] * 7
    alone = pricing.serving_pass(LLAMA, H100, prefill)["compute"]
    mixed = pricing.serving_pass(LLAMA, H100, prefill + decodes)["compute"]
    assert alone < mixed < alone * 1.05


def test_the_training_step_and_the_planner_share_one_layer_price():
    """The planner's compute is kernels.training_forward's (pricing.training_layer): one
    layout's compute term is its layers x (forward + backward) + the head, by hand."""
    out = planner.plan(LLAMA, 8, "H100", global_batch=8, seq=4096, top=1,
                       fix="dp=8,tp=1,pp=1,cp=1,micro_batch_size=1,zero_stage=1,recompute=none")
    best = out["plans"][0]
    c = planner.make_cluster("H100", 8)
    fwd = pricing.training_layer(LLAMA, 4096, 4096, c.gpu, 1, 1, 1, True, True, 2,
                                 c.gpu.bf16_flops * c.achievable, c.gpu.bf16_flops * c.achievable,
                                 c.kernel_launch_s, False, False, 1)
    layers = LLAMA.layers
    compute = layers * (fwd["gemm"] + fwd["gemm_backward"] + fwd["attention"]
                        + fwd["attention_backward"] + fwd["launch"] + fwd["backward_launch"]) \
        + fwd["head"] + fwd["head_backward"] + 3 * fwd["head_launch"]
    elementwise = (layers * (fwd["forward_bytes"] + fwd["backward_bytes"]) + fwd["head_bytes"]) \
        / kernels.hbm_bandwidth(c.gpu)
    assert best["breakdown_s"]["compute"] == pytest.approx(compute + elementwise, rel=1e-9)
