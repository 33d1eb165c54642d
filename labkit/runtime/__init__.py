"""The runtime every technique stands on: launch ranks, logged collectives, memory, clock.

Names are imported on first use (PEP 562), so `labkit.runtime.cpus` comes without torch."""
import importlib

# (`launch` itself is `labkit.launch`: here the name is its submodule, runtime/launch.py)
_LAZY = {"Context": "labkit.runtime.context", "Group": "labkit.runtime.context",
         "LaunchError": "labkit.runtime.launch"}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'labkit.runtime' has no attribute {name!r}")
