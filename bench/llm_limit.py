"""A provider's tokens-per-minute limit, for the fake LLM (``bench/llm_server.py --tpm``):
the rate-limit bench's provider (``python -m bench.ratelimit``).

Every request's tokens (its ``usage``: the prompt's and the reply's, as the fake counts
them) are counted when it arrives; over any ``window_s`` at most ``tpm * window_s / 60``
are accepted, as a provider that counts per minute does. A request beyond that is
answered 429 with ``Retry-After`` (and OpenAI's ``retry-after-ms``): how long until the
window has room for it.
"""

from __future__ import annotations

import math
import time
from collections import deque


class ProviderLimit:
    def __init__(self, tpm: int, window_s: float = 60.0) -> None:
        self.limit = tpm * window_s / 60
        self.window_s = window_s
        self.used = 0
        self.accepted_tokens = 0  # ever
        self.rejected = 0  # requests answered 429
        self._entries: deque[tuple[float, int]] = deque()  # (arrived, tokens)

    def take(self, tokens: int, now: float | None = None) -> float | None:
        """Count a request of ``tokens``: ``None`` if accepted, else the seconds until
        the window has room for it."""
        now = time.monotonic() if now is None else now
        entries = self._entries
        while entries and entries[0][0] + self.window_s <= now:
            self.used -= entries.popleft()[1]
        if self.used + tokens <= self.limit or not entries:
            entries.append((now, tokens))
            self.used += tokens
            self.accepted_tokens += tokens
            return None
        self.rejected += 1
        freed = 0
        for arrived, n in entries:
            freed += n
            if self.used - freed + tokens <= self.limit:
                return max(arrived + self.window_s - now, 0.001)
        return self.window_s


def retry_headers(seconds: float) -> bytes:
    """``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms``."""
    return b"retry-after: %d\r\nretry-after-ms: %d\r\n" % (
        math.ceil(seconds), math.ceil(seconds * 1000),
    )  # fmt: skip
