"""Python's thread switch interval, shortened while loads are in flight."""

from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger(__name__)

# The interval while loads are in flight: measured on CPU engines, loads at 0.03 GB/s
# with Python's 5 ms against 1.04 GB/s at 0.2 ms (docs/performance.md, warm loads).
LOAD_SWITCH_INTERVAL_MS = 0.2


class LoadSwitchInterval:
    """Python's thread switch interval, shortened while loads are in flight, process-wide.

    A transfer thread gives up the GIL on every socket read; while vLLM's engine loop or
    forward pass runs Python, taking it back waits up to the interval (5 ms by default)
    each time, hundreds of times per load. A short interval makes every thread of the
    process switch that often, though, the forward pass's too: so it holds only while
    some worker of the process has a load in flight (stores wait for nobody)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: float | None = None
        self._logged = False

    def hold(self, ms: float) -> bool:
        """Shorten the interval to ``ms`` milliseconds if it is longer (0: no change)
        until the matching ``release``; returns whether the caller must release."""
        if ms <= 0:
            return False
        with self._lock:
            self._holders += 1
            current = sys.getswitchinterval()
            if self._saved is None and current > ms / 1e3:
                self._saved = current
                sys.setswitchinterval(ms / 1e3)
                if not self._logged:
                    self._logged = True
                    log.info(
                        "umbp-redis: Python's thread switch interval is %.2f ms while loads "
                        "are in flight (%.2f ms otherwise)",
                        ms,
                        current * 1e3,
                    )
        return True

    def release(self) -> None:
        """End one ``hold``; the last one restores the interval it found."""
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._saved is not None:
                sys.setswitchinterval(self._saved)
                self._saved = None


# The process's one switch-interval holder (the interval is a process-wide setting).
LOAD_SWITCH_INTERVAL = LoadSwitchInterval()
