"""Per-key limits: requests and tokens per minute, requests in flight, token budgets per day and month.

Requests and tokens per minute are buckets refilled continuously (a key with 60 requests per minute gets one
more each second, up to 60 at once). Tokens are charged when a request ends, from the usage the engine
reported (prompt + completion): a key is admitted while its token bucket holds any, and one request may take
it below zero, which the next ones wait out. Budgets count the same tokens per UTC day and calendar month,
and start again at the period's start. The clock is injected (wall-clock seconds), so tests move it.

The state lives per key name and survives reloads: a key whose limits change keeps what it used.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.config import KeyLimits

Clock = Callable[[], float]


@dataclass
class Bucket:
    """``capacity`` units, refilled at ``capacity`` per ``period_s``; the level may go below zero (charged after)."""

    capacity: int
    at: float  # when the level was last brought up to date
    period_s: float = 60.0
    level: float = field(default=math.nan)  # starts full

    def __post_init__(self) -> None:
        if math.isnan(self.level):
            self.level = float(self.capacity)

    @property
    def per_s(self) -> float:
        return self.capacity / self.period_s

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(float(self.capacity), self.level + (now - self.at) * self.per_s)
        self.at = max(self.at, now)

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.level = min(self.level, float(capacity))

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.level))

    def wait_s(self, need: float = 1.0) -> float:
        """Seconds until the level reaches ``need``."""
        return max(0.0, (need - self.level) / self.per_s)

    def full_in_s(self) -> float:
        """Seconds until the bucket is full again (what the rate-limit reset headers say)."""
        return max(0.0, (self.capacity - self.level) / self.per_s)


def period_start(now: float, period: str) -> float:
    """The start (epoch seconds) of the UTC day or calendar month holding ``now``."""
    moment = dt.datetime.fromtimestamp(now, dt.UTC)
    if period == "day":
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    else:
        start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return start.timestamp()


def next_period_start(now: float, period: str) -> float:
    start = dt.datetime.fromtimestamp(period_start(now, period), dt.UTC)
    if period == "day":
        return (start + dt.timedelta(days=1)).timestamp()
    return (start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)).timestamp()


@dataclass
class Budget:
    """Tokens used in the current period (a UTC ``day`` or ``month``)."""

    limit: int
    period: str
    used: int = 0
    since: float = 0.0  # the current period's start

    def roll(self, now: float) -> None:
        start = period_start(now, self.period)
        if start != self.since:
            self.since, self.used = start, 0


@dataclass(frozen=True)
class Refusal:
    """Why a request of this key is refused now, and when to retry."""

    message: str
    code: str
    retry_after_s: float


class KeyQuota:
    """One key's limits and what it used."""

    def __init__(self, limits: KeyLimits, now: float) -> None:
        self.limits = KeyLimits()
        self.requests: Bucket | None = None
        self.tokens: Bucket | None = None
        self.day: Budget | None = None
        self.month: Budget | None = None
        self.in_flight = 0
        self.update(limits, now)

    def update(self, limits: KeyLimits, now: float) -> None:
        """Take new limits (a reload), keeping what was used under the old ones."""
        if limits == self.limits:
            return
        self.limits = limits
        self.requests = _bucket(self.requests, limits.requests_per_minute, now)
        self.tokens = _bucket(self.tokens, limits.tokens_per_minute, now)
        self.day = _budget(self.day, limits.tokens_per_day, "day", now)
        self.month = _budget(self.month, limits.tokens_per_month, "month", now)

    def admit(self, now: float) -> Refusal | None:
        """Take one request (None), or say why not; an admitted request must be given back by :meth:`finish`."""
        limits = self.limits
        if limits.max_concurrent is not None and self.in_flight >= limits.max_concurrent:
            return Refusal(f"this key has {self.in_flight} requests in flight, its limit", "too_many_concurrent_requests", 1.0)
        if self.requests is not None:
            self.requests.refill(now)
            if self.requests.level < 1:
                wait = self.requests.wait_s()
                return Refusal(f"rate limit reached: {limits.requests_per_minute} requests per minute", "rate_limit_exceeded", wait)
        if self.tokens is not None:
            self.tokens.refill(now)
            if self.tokens.level <= 0:
                wait = self.tokens.wait_s()
                return Refusal(f"rate limit reached: {limits.tokens_per_minute} tokens per minute", "rate_limit_exceeded", wait)
        for budget in (self.day, self.month):
            if budget is not None:
                budget.roll(now)
                if budget.used >= budget.limit:
                    wait = next_period_start(now, budget.period) - now
                    return Refusal(f"token budget spent: {budget.limit} tokens per {budget.period}", "insufficient_quota", wait)
        if self.requests is not None:
            self.requests.level -= 1
        self.in_flight += 1
        return None

    def finish(self, tokens: int, now: float) -> None:
        """An admitted request ended, having used ``tokens`` (prompt + completion)."""
        self.in_flight = max(0, self.in_flight - 1)
        if tokens <= 0:
            return
        if self.tokens is not None:
            self.tokens.refill(now)
            self.tokens.level -= tokens
        for budget in (self.day, self.month):
            if budget is not None:
                budget.roll(now)
                budget.used += tokens


def _bucket(old: Bucket | None, capacity: int | None, now: float) -> Bucket | None:
    if capacity is None:
        return None
    if old is None:
        return Bucket(capacity, at=now)
    old.refill(now)
    old.resize(capacity)
    return old


def _budget(old: Budget | None, limit: int | None, period: str, now: float) -> Budget | None:
    if limit is None:
        return None
    if old is None:
        return Budget(limit, period, since=period_start(now, period))
    old.limit = limit
    return old


class Quotas:
    """Every named key's :class:`KeyQuota`, by name (kept across reloads; made on first use)."""

    def __init__(self, clock: Clock = time.time) -> None:
        self.clock = clock
        self._by_name: dict[str, KeyQuota] = {}

    def of(self, name: str, limits: KeyLimits) -> KeyQuota:
        """The quota of key ``name``, brought to ``limits`` (those in force now)."""
        quota = self._by_name.get(name)
        if quota is None:
            quota = self._by_name[name] = KeyQuota(limits, self.clock())
        elif quota.limits != limits:
            quota.update(limits, self.clock())
        return quota
