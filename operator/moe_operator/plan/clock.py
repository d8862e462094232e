"""Timestamps as the status stores them (RFC 3339, UTC, whole seconds) and back."""

from __future__ import annotations

import datetime

UTC = datetime.timezone.utc


def rfc3339(moment: datetime.datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse(text: str | None) -> datetime.datetime | None:
    """An RFC 3339 timestamp of the status (``None`` when absent or unreadable)."""
    if not text:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def from_epoch(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, tz=UTC)
