"""A non-editable install (a wheel, as `pip install .` makes) carries the data tables as package
data and finds them, away from the checkout's data/ folder."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import labkit.theory.catalog as catalog, labkit.theory.hardware as hardware
import labkit.theory.planner as planner, labkit.theory.published as published
assert hardware.__file__.startswith(INSTALLED), hardware.__file__
assert str(hardware.TABLES).startswith(INSTALLED)
print(hardware.gpu("H100").name, catalog.model("llama-3-70b").param_count(),
      len(hardware.table()), len(catalog.table()), len(published.runs()), sep="|")
"""


def test_a_wheel_install_finds_its_tables(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT / "labkit", source / "labkit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", source)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path / "wheel"), str(source)], check=True, cwd=tmp_path,
                   timeout=240)
    wheel = next((tmp_path / "wheel").glob("labkit-*.whl"))
    installed = tmp_path / "installed"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(installed), str(wheel)],
                   check=True, timeout=240)
    assert (installed / "labkit" / "tables" / "hardware.csv").is_file()
    env = dict(os.environ, PYTHONPATH=str(installed))  # ahead of the editable checkout
    out = subprocess.run([sys.executable, "-c", f"INSTALLED = {str(installed)!r}\n" + CHECK],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    from labkit.theory import catalog, hardware, published  # the checkout's, for comparison
    expected = [hardware.gpu("H100").name, catalog.model("llama-3-70b").param_count(),
                len(hardware.table()), len(catalog.table()), len(published.runs())]
    assert out.stdout.strip().split("|") == [str(x) for x in expected]


# --- torch: a tested range in pyproject.toml, one exact version where labkit installs it ------

def _torch_requirement():
    import tomllib

    from packaging.requirements import Requirement
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == "torch")


def _exact_pins():
    import re
    make = re.search(r"^TORCH_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    conda = re.search(r"^\s*- torch==(\S+)", (ROOT / "environment.yml").read_text(), re.M)
    return make.group(1), conda.group(1)


def test_torch_is_a_range_in_pyproject_and_exact_where_labkit_installs_it():
    import torch
    spec = _torch_requirement().specifier
    assert len(spec) == 2 and {s.operator for s in spec} == {">=", "<"}, str(spec)
    assert "2.11.0" in spec and "2.13.0" in spec      # the two versions the tests ran on
    assert "2.10.0" not in spec and "2.14.0" not in spec
    make, conda = _exact_pins()
    assert make == conda and make in spec
    assert spec.contains(torch.__version__.split("+")[0])


def test_pip_install_editable_resolves_with_the_installed_torch(tmp_path):
    """`pip install -e .` (dry run, offline: only what is installed) keeps this torch: no other
    torch would be downloaded."""
    source = tmp_path / "source"
    shutil.copytree(ROOT / "labkit", source / "labkit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", source)
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                          "--no-build-isolation", "--disable-pip-version-check", "-e",
                          str(source)], capture_output=True, text=True, cwd=tmp_path,
                         timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    would = [line for line in out.stdout.splitlines() if line.startswith("Would install")]
    assert would and "labkit" in would[0] and "torch" not in would[0], out.stdout[-2000:]
