"""A consecutive-failure circuit breaker with exponential half-open probing (used by the Redis and peer tiers).

Contract: closed until `failures` calls in a row fail; then open: `allow()` is False (callers answer at once,
without touching the network) except for one probe per backoff window. The window starts at `backoff_start_s`
and doubles after each failed probe, up to `backoff_max_s`; a success closes the breaker and resets the window.
Thread safe. `clock` (default time.monotonic) is injectable so that tests need not sleep.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

BACKOFF_START_S = 0.1


class CircuitBreaker:
    def __init__(self, failures: int, backoff_max_s: float, backoff_start_s: float = BACKOFF_START_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = max(1, failures)
        self.backoff_start_s = min(backoff_start_s, backoff_max_s)
        self.backoff_max_s = backoff_max_s
        self.failures = 0
        self.backoff_s = self.backoff_start_s  # the window after the next failure
        self._clock = clock
        self._retry_at = 0.0
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self.failures >= self.threshold

    def allow(self) -> bool:
        """True if a call may go to the network now (closed, or this caller is the half-open probe)."""
        if self.failures < self.threshold:
            return True
        with self._lock:
            now = self._clock()
            if now < self._retry_at:
                return False
            self._retry_at = now + self.backoff_s  # only one probe per backoff window
            return True

    def success(self) -> bool:
        """Record a success; True if it closed an open breaker."""
        if not self.failures:
            return False
        with self._lock:
            was_open = self.failures >= self.threshold
            self.failures = 0
            self.backoff_s = self.backoff_start_s
            return was_open

    def failure(self) -> bool:
        """Record a failure; True if this one opened (or re-opened) the breaker."""
        with self._lock:
            self.failures += 1
            if self.failures < self.threshold:
                return False
            self._retry_at = self._clock() + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, self.backoff_max_s)
            return True
