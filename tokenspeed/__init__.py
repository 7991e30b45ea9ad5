"""TokenSpeed: an inference and serving engine for the Kimi K3 model family."""

__version__ = "0.1.0"
