"""The regions one process keeps built between messages, bounded by count and memory.

With a shared base each region costs a few MiB; without, each holds a whole base, which
the memory bound is for. The least recently used go first; the newest is always kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from fedciuic.errors import ConfigError

#: Regions kept per process at most (the count bound).
MAX_REGIONS = 4
#: The memory bound's default, in MiB of what the cached regions hold privately.
DEFAULT_BUDGET_MIB = 2048
BUDGET_ENV = "FEDCIUIC_REGION_CACHE_MIB"

T = TypeVar("T")


def budget_bytes() -> int:
    """``FEDCIUIC_REGION_CACHE_MIB`` in bytes, else the default."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return DEFAULT_BUDGET_MIB * 2**20
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if mib < 0:
        raise ConfigError(
            [f"environment:{BUDGET_ENV}: {text!r} is not a size in MiB; set a number >= 0"]
        )
    return int(mib * 2**20)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return trim


def release_freed_memory() -> None:
    """Hand the freed heap back to the system, once a run at its end: between rounds the
    next messages fault every page in again (0.6-0.7 s a message, no lower peak)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class BoundedCache(Generic[T]):
    """Least recently used values, at most ``count`` and ``budget`` bytes (``size_of``);
    ``close`` stops an evicted value's training processes, which gc would leave running."""

    def __init__(
        self,
        size_of: Callable[[T], int],
        count: int = MAX_REGIONS,
        budget: int | None = None,
        close: Callable[[T], None] = lambda _: None,
    ) -> None:
        self.size_of, self.close, self.count, self.budget = size_of, close, count, budget
        self.entries: OrderedDict[Hashable, tuple[T, int]] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key][0]
        value = build()
        self.entries[key] = (value, self.size_of(value))
        self._trim()
        return value

    def held_bytes(self) -> int:
        return sum(size for _, size in self.entries.values())

    def clear(self) -> None:
        for value, _ in self.entries.values():
            self.close(value)
        self.entries.clear()
        gc.collect()

    def _trim(self) -> None:
        budget = self.budget if self.budget is not None else budget_bytes()
        evicted = False
        while len(self.entries) > 1 and (
            len(self.entries) > self.count or self.held_bytes() > budget
        ):
            _, (value, _) = self.entries.popitem(last=False)
            self.close(value)
            evicted = True
        if evicted:
            gc.collect()  # peft models hold reference cycles; free the evicted base now
