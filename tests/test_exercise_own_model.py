"""Lesson 11's exercise checker (labkit.exercises.your_own_model): a tensor-parallel plan for
HF Phi, which has no preset. The right plan equals one device on 2 ranks (labkit.numerics) and
halves the split layers; each plausible wrong plan gets its own diagnosis, with what the run
on 2 ranks gave; what is not a plan is answered in one line without starting ranks."""
import pytest

pytest.importorskip("transformers")

from labkit.exercises import reset_hints  # noqa: E402
from labkit.exercises.your_own_model import SOLUTION, check_own_plan, check_plans  # noqa: E402

WRONG = {  # name -> (plan, problem tag, words the message must say)
    "swapped": ({**SOLUTION, "model.layers.*.mlp.fc1": "rowwise",
                 "model.layers.*.mlp.fc2": "colwise"}, "swapped",
                ["column and row swapped: fc1, fc2", "raised"]),
    "missed-pair": ({k: v for k, v in SOLUTION.items() if not k.endswith("fc2")}, "missed",
                    ["fc2 is in no entry", "its pair is broken", "raised"]),
    "missed-k-v": ({k: v for k, v in SOLUTION.items() if not k.endswith(("k_proj", "v_proj"))},
                   "missed", ["k_proj, v_proj are in no entry", "k_proj, v_proj stay whole"]),
    "missed-mlp": ({k: v for k, v in SOLUTION.items() if ".mlp." not in k}, "missed",
                   ["fc1, fc2 are in no entry", "left whole", "equals one device"]),
    "attention-as-fused": ({"model.layers.*.self_attn": "colwise",
                            "model.layers.*.mlp.fc1": "colwise",
                            "model.layers.*.mlp.fc2": "rowwise"}, "attention as fused",
                           ["names the whole attention (PhiAttention)", "labkit refuses"]),
    "phi3-fused-names": ({"model.layers.*.self_attn.qkv_proj": "colwise",
                          "model.layers.*.self_attn.dense": "rowwise",
                          "model.layers.*.mlp.gate_up_proj": "colwise",
                          "model.layers.*.mlp.fc2": "rowwise"}, "fused names",
                         ["gate_up_proj, qkv_proj are fused projections of other families",
                          "labkit refuses"]),
    "dense-as-vocab": ({**SOLUTION, "model.layers.*.self_attn.dense": "vocab"}, "vocab",
                       ["dense planned 'vocab'"]),
    "typo": ({**SOLUTION, "model.layers.*.mlp.fc3": "rowwise"}, "refused",
             ["'model.layers.*.mlp.fc3' matches no module of PhiForCausalLM",
              "model.layers.0.mlp.fc1)"]),     # labkit's refusal whole, its list not cut
    "no-model-prefix": ({k.removeprefix("model."): v for k, v in SOLUTION.items()},
                        "no model. prefix", ["sit under `model.`", "Nothing ran",
                                             "labkit refuses", "model.layers.0.mlp.fc1)"]),
    "head-rowwise": ({**SOLUTION, "lm_head": "rowwise"}, "head rowwise",
                     ["lm_head planned 'rowwise'", "its input", "raised"]),
    "head-colwise": ({**SOLUTION, "lm_head": "colwise"}, "head colwise",
                     ["leaves the logits split", "needs the gathered logits", "raised"]),
}
NOT_SAID = {"no-model-prefix": ["right numbers", "no memory"],
            "head-rowwise": ["reads right to the lab"],
            "head-colwise": ["labkit refuses"]}   # the loss's error is the run's, not labkit's


@pytest.fixture(scope="module")
def checks():
    reset_hints()
    plans = [SOLUTION, {k: v for k, v in SOLUTION.items() if "lm_head" not in k}]
    plans += [plan for plan, _, _ in WRONG.values()]
    return check_plans(plans, verbose=False)


def test_the_right_plan_equals_one_device_and_halves_the_layers(checks):
    right, without_head = checks[:2]
    assert right.ok, right.message
    assert "equals one device" in right.message and "within rounding" in right.message
    share = int(right.message.split("% of the model")[0].rsplit(" ", 1)[-1])
    assert 45 <= share <= 55     # biases and norms stay whole: a little over half
    assert without_head.ok and "lm_head whole" in without_head.message


@pytest.mark.parametrize("name", list(WRONG))
def test_each_wrong_plan_gets_its_own_diagnosis(checks, name):
    check = checks[2 + list(WRONG).index(name)]
    _, problem, words = WRONG[name]
    assert not check.ok and check.problem == problem, check.message
    for said in words:
        assert said in check.message, (said, check.message)
    for wrong in NOT_SAID.get(name, ()):
        assert wrong not in check.message, (wrong, check.message)


def test_what_is_not_a_plan_is_answered_in_one_line():
    reset_hints()
    none, number, empty, styles = check_plans([None, 3, {}, {"lm_head": 1}], verbose=False)
    assert none.problem == "no answer" and none.message.startswith("No answer yet")
    for check in (number, empty, styles):
        assert check.problem == "not a plan" and "\n" not in check.message
    assert check_own_plan(None, verbose=False).problem == "no answer"
