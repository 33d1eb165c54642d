"""The planner's one fitted number is the fit, on the declared calibration rows only.

kernels.IN_STEP_GEMM_FRACTION (data/kernels.csv) must be what published.fit_in_step_gemm_fraction
finds on the `calibration` rows of data/published_runs.csv (Narayanan et al. 2021 Table 1), so
nobody can tune it by hand towards the check rows; and the fit must not look at a check row."""
import pytest

from labkit.theory import kernels, published


def test_the_stored_fraction_is_the_fit_on_the_calibration_rows():
    assert published.fit_in_step_gemm_fraction() == pytest.approx(
        kernels.IN_STEP_GEMM_FRACTION, abs=0.005)


def test_at_the_stored_fraction_the_calibration_rows_average_no_error():
    rows = published.check(published.runs("calibration"))
    assert abs(sum(r["error"] for r in rows) / len(rows)) < 0.01


def test_the_fit_ignores_check_rows():
    calibration = published.runs("calibration")
    with_checks = calibration + published.runs("check")
    assert published.fit_in_step_gemm_fraction(with_checks) == \
        published.fit_in_step_gemm_fraction(calibration)


def test_the_fraction_slows_training_gemms_and_nothing_else():
    row = published.runs("calibration")[0]
    fitted = published.predict(row)["explain_s"]
    alone = published.predict(row, in_step_gemm_fraction=1.0)["explain_s"]
    assert fitted["gemm"] == pytest.approx(alone["gemm"] / kernels.IN_STEP_GEMM_FRACTION,
                                           rel=1e-9)
    for part in ("attention_forward", "attention_backward", "elementwise", "launches"):
        assert fitted[part] == pytest.approx(alone[part], rel=1e-9)


def test_an_empty_calibration_set_is_refused():
    with pytest.raises(ValueError, match="no calibration rows"):
        published.fit_in_step_gemm_fraction([dict(r, use="check")
                                              for r in published.runs("calibration")])
