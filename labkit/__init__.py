"""labkit: run, measure and model the ways large networks are trained on many GPUs."""
from .runtime import Context, LaunchError, launch

__version__ = "0.1.0"
__all__ = ["Context", "LaunchError", "launch"]
