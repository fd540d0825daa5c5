"""One lock per claim: a claim is prepared or unprepared by one call at a time, while calls on
other claims go on. A call holds the locks of all its claims, taken in uid order, so two calls
sharing claims never wait for each other in turn; a claim's lock goes once no call uses it.

    locks = ClaimLocks()
    async with locks.held(["uid-2", "uid-1"]): ...
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Iterable


class ClaimLocks:
    def __init__(self) -> None:
        self._busy: dict[str, tuple[asyncio.Lock, int]] = {}  # uid → (its lock, calls using it)

    def __len__(self) -> int:
        """Claims some call uses now (holds or waits for)."""
        return len(self._busy)

    @contextlib.asynccontextmanager
    async def held(self, uids: Iterable[str]) -> AsyncIterator[None]:
        ordered = sorted(set(uids))
        locks = []
        for uid in ordered:
            lock, users = self._busy.get(uid) or (asyncio.Lock(), 0)
            self._busy[uid] = (lock, users + 1)
            locks.append(lock)
        try:
            async with contextlib.AsyncExitStack() as stack:
                for lock in locks:
                    await stack.enter_async_context(lock)
                yield
        finally:
            for uid in ordered:
                lock, users = self._busy[uid]
                if users == 1:
                    del self._busy[uid]
                else:
                    self._busy[uid] = (lock, users - 1)
