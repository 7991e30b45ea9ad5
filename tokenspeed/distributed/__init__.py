"""Process groups and collectives; everything is a no-op at world size 1."""

from tokenspeed.distributed.parallel import ParallelContext

__all__ = ["ParallelContext"]
