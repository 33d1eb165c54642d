"""The runtime every technique stands on: launch ranks, logged collectives, memory, clock."""
from .context import Context, Group
from .launch import LaunchError, launch

__all__ = ["Context", "Group", "LaunchError", "launch"]
