"""A request's page table: a plain `list` of page ids that keeps an int32 numpy copy of itself.

`ForwardBatch.build` turns page tables into one padded int32 device tensor every step; converting the Python ints
costs O(pages) per sequence per step (~30 ns each: 2 ms for 256 sequences of 4K tokens in pages of 16). A
`PageList` grows its copy as the cache manager extends it (amortised O(1) per page), so `build` copies numpy rows
instead. Any other mutation drops the copy (`host_array()` then returns None and `build` converts the list).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Self

import numpy as np


class PageList(list):
    """list[int] of page ids with `host_array()`: the same ids as an int32 numpy array (None when not kept)."""

    _array: np.ndarray | None = None  # capacity >= len(self); entries [0, _size) mirror the list
    _size = 0

    def __init__(self, pages: Iterable[int] = ()) -> None:
        super().__init__(pages)
        self._array = np.empty(max(16, 2 * len(self)), dtype=np.int32)
        self._array[: len(self)] = self
        self._size = len(self)

    def __reduce_ex__(self, protocol):  # copy / deepcopy / pickle: a fresh PageList with its own array
        return type(self), (list(self),)

    def host_array(self) -> np.ndarray | None:
        """The ids as int32 (a view that later growth does not change), or None if the copy was dropped."""
        if self._array is None or self._size != len(self):
            return None
        return self._array[: self._size]

    def _push(self, pages: list[int]) -> None:
        array, n = self._array, self._size
        if array is None or n + len(pages) != len(self):
            self._array = None
            return
        if n + len(pages) > array.shape[0]:  # a new buffer: views handed out keep the old one
            grown = np.empty(max(2 * array.shape[0], n + len(pages)), dtype=np.int32)
            grown[:n] = array[:n]
            self._array = array = grown
        array[n : n + len(pages)] = pages
        self._size = n + len(pages)

    def append(self, page: int) -> None:
        super().append(page)
        self._push([page])

    def extend(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        super().extend(pages)
        self._push(pages)

    def __iadd__(self, pages: Iterable[int]) -> Self:  # type: ignore[override]
        self.extend(pages)
        return self

    def _drop(name: str):  # builds the mutators below (a plain function while the class body runs)
        method = getattr(list, name)

        def mutate(self, *args, **kwargs):
            self._array = None
            return method(self, *args, **kwargs)

        mutate.__name__ = name
        return mutate

    __setitem__ = _drop("__setitem__")
    __delitem__ = _drop("__delitem__")
    __imul__ = _drop("__imul__")
    insert = _drop("insert")
    pop = _drop("pop")
    remove = _drop("remove")
    clear = _drop("clear")
    sort = _drop("sort")
    reverse = _drop("reverse")
    del _drop
