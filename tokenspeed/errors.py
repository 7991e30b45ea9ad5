"""Error types that reach users.

`ConfigError` is raised for a configuration the engine cannot run (an unknown architecture, an unsupported
option, inconsistent sizes); its message says what is supported and how to fix the input.
`CheckpointError` is raised when a checkpoint does not match the model it is loaded into; its message lists
every missing, unexpected and mis-shaped tensor by name.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration the engine cannot run; the message says how to fix it."""


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the model; the message lists the offending names."""
