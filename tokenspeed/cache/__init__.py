"""Cache bookkeeping (see docs/cache.md): pages, the prefix index, state slots and checkpoints.

Layering: `hashing` and `page_pool`, `slot_pool` know nothing of each other; `manager` composes them and is the
only thing the scheduler calls. Nothing here touches tensors (a `PageList` keeps a numpy copy of its page ids,
which the executor uploads).
"""

from tokenspeed.cache.manager import Admission, CacheManager, CachePlan
from tokenspeed.cache.page_list import PageList

__all__ = ["Admission", "CacheManager", "CachePlan", "PageList"]
