"""Cache bookkeeping (see docs/cache.md): pages, the prefix index, state slots and checkpoints.

Layering: `hashing` and `page_pool`, `slot_pool` know nothing of each other; `manager` composes them and is the
only thing the scheduler calls. Nothing here touches tensors.
"""

from tokenspeed.cache.manager import CacheManager, CachePlan, Admission

__all__ = ["Admission", "CacheManager", "CachePlan"]
