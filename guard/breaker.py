"""One "Redis just failed" window, shared by everything that talks to the same Redis.

After a failure, callers skip Redis for ``cooldown`` seconds instead of each waiting out its
own socket timeout: a guard lookup that failed spares the cache read after it, and the
other way round.
"""

from __future__ import annotations

import time


class RedisBreaker:
    def __init__(self, cooldown: float = 1.0) -> None:
        self.cooldown = cooldown
        self._open_until = 0.0

    def trip(self) -> None:
        self._open_until = time.monotonic() + self.cooldown

    @property
    def open(self) -> bool:
        """True while Redis is being skipped."""
        return time.monotonic() < self._open_until
