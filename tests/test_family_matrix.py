"""The family matrix (scripts/family_matrix.py, `make family-matrix` for all of it) on a
representative subset: Llama (the family every block knows), Falcon (attention and MLP summed in
place; a causal mask built on every call) and Qwen2-MoE (experts, a shared expert), through
FullyShard, context parallelism and expert parallelism on 2 ranks against one device: each cell
EQUAL within labkit.numerics' rule, Falcon's CP refused in one line with advice, nothing WRONG.
The judge itself calls a result that is off by a gradient's size WRONG.
"""
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import family_matrix as fm  # noqa: E402

FAMILIES = ("llama", "falcon", "qwen2_moe")
BLOCKS = ("FullyShard", "CP", "EP")


@pytest.fixture(scope="module")
def cells():
    return fm.run_matrix(list(FAMILIES), BLOCKS, log=lambda _: None)


def test_subset_equal_one_device_or_refused_in_one_line(cells):
    expected = {"llama": ("EQUAL", "EQUAL", "n/a"), "falcon": ("EQUAL", "REFUSED", "n/a"),
                "qwen2_moe": ("EQUAL", "EQUAL", "EQUAL")}
    got = {f: tuple(cells[f][b][0] for b in BLOCKS) for f in FAMILIES}
    assert got == expected, {f: cells[f] for f in FAMILIES}
    message = cells["falcon"]["CP"][1]
    assert "causal attn_mask" in message and "causal_sdpa()" in message and "\n" not in message
    table = fm.markdown(cells, {}, BLOCKS, 0.0)
    assert "| falcon | EQUAL " in table and "Totals: 6 EQUAL, 1 REFUSED, 2 n/a." in table
    assert f"- falcon / CP (REFUSED): {message}" in table


def test_a_result_off_by_a_gradient_is_wrong():
    reference = fm.one_device("llama")
    right = reference[torch.float32]
    off = {n: p + (0.01 if n.endswith("q_proj.weight") else 0.0) for n, p in right.items()}
    assert fm.judge("DDP", [{"DDP": ("ran", right)}] * 2, reference)[0] == "EQUAL"
    verdict, detail = fm.judge("DDP", [{"DDP": ("ran", off)}] * 2, reference)
    assert verdict == "WRONG" and "NOT within rounding" in detail
    tokens = reference["tokens"].clone()
    tokens[0, -1] += 1
    ranks = [{"generate": ("ran", tokens)}] * 2
    assert fm.judge("generate", ranks, reference) == ("WRONG", "1 tokens differ")


def test_a_family_whose_cache_is_its_own_is_refused_by_generate_in_one_line():
    """CPM-Ant's forward does not take transformers' cache as labkit passes it (the matrix's
    one ERROR cell before): generate says so in one line, and the matrix counts it REFUSED."""
    from labkit.parallel import serving
    try:
        model = fm.build("cpmant")
    except Exception as error:  # noqa: BLE001 - a transformers without CPM-Ant
        pytest.skip(f"cpmant does not build here: {error}")
    with pytest.raises(ValueError, match=r"^generate: CpmAntForCausalLM failed on transformers' "
                       r"cache as labkit passes it .*use model\.generate$") as caught:
        serving.generate(model, fm.data()[:, :fm.PROMPT], fm.NEW)
    assert "\n" not in str(caught.value) and fm.refused_by_labkit(caught.value)
