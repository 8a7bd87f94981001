"""Deadlines for outbound calls.

Every outbound call takes ``Deadline.timeout(default_s)``: the smaller of the configured per-call timeout and the
caller's remaining time minus a safety margin, so a downstream call never outlives its caller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.common.errors import UpstreamTimeout


@dataclass(frozen=True)
class Deadline:
    """An absolute point on the monotonic clock (seconds), or ``None`` for no deadline."""

    expires_at: float | None = None

    @classmethod
    def from_remaining(cls, remaining_s: float | None) -> Deadline:
        """A deadline ``remaining_s`` seconds from now (``None``: no deadline), e.g. ``context.time_remaining()``."""
        return cls(None if remaining_s is None else time.monotonic() + remaining_s)

    def remaining(self) -> float | None:
        """Seconds left (may be negative), or ``None`` without a deadline."""
        return None if self.expires_at is None else self.expires_at - time.monotonic()

    def timeout(self, default_s: float, margin_s: float = 0.25) -> float:
        """Timeout in seconds for one outbound call.

        Raises:
            UpstreamTimeout: less than ``margin_s`` is left.
        """
        remaining = self.remaining()
        if remaining is None:
            return default_s
        if remaining <= margin_s:
            raise UpstreamTimeout("the request's deadline has passed")
        return min(default_s, remaining - margin_s)
