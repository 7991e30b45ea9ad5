"""`ExtendedTokens`: a token list with a few tokens after it, read without copying the list (a request's tokens
plus the drafts of a verify window: the cache commit's positions, a sampled window position's output tokens)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence


class ExtendedTokens(Sequence):
    """`base + tail` as a read-only sequence that does not copy `base`: O(1) to build; a slice costs its length,
    and iteration runs at C speed (itertools.chain). `base` must not change while the view is in use."""

    __slots__ = ("base", "tail")

    def __init__(self, base: Sequence[int], tail: Sequence[int]) -> None:
        self.base, self.tail = base, tail

    def __len__(self) -> int:
        return len(self.base) + len(self.tail)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.base, self.tail)

    def __getitem__(self, i):
        n = len(self.base)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            if stop <= n:
                return self.base[start:stop]
            return list(self.base[start:n]) + list(self.tail[max(start - n, 0):stop - n])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.base[i] if i < n else self.tail[i - n]
