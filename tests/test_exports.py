"""Names a learner can carry to PyTorch: the blocks importable from `labkit.parallel` (without
importing torch until one is used), DistributedDataParallel, and one version string."""
import importlib.metadata
import subprocess
import sys

import labkit
import labkit.parallel


def test_every_block_is_exported_from_labkit_parallel():
    for name in labkit.parallel.__all__:
        assert callable(getattr(labkit.parallel, name)), name
    from labkit.parallel import FullyShard, HybridParallel  # noqa: F401  (the issue's failing line)


def test_importing_labkit_parallel_imports_no_torch():
    code = "import sys, labkit.parallel; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_distributed_data_parallel_is_the_data_parallel_block():
    from labkit.parallel.data_parallel import DataParallel, DistributedDataParallel
    assert labkit.DistributedDataParallel is DistributedDataParallel
    assert labkit.parallel.DistributedDataParallel is DistributedDataParallel
    assert issubclass(DataParallel, DistributedDataParallel)   # the old name, deprecated


def test_one_version_string():
    assert importlib.metadata.version("labkit") == labkit.__version__
