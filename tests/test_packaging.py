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
