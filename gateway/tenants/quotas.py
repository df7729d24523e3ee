"""Per-key limits: requests and tokens per minute, requests in flight, token budgets per day and month.

Requests and tokens per minute are buckets refilled continuously (a key with 60 requests per minute gets one
more each second, up to 60 at once). Tokens are reserved at admission (:meth:`KeyQuota.reserve`: what the request
may cost at most) and settled at its end with the usage the engine reported (prompt + completion), so concurrent
requests cannot spend a budget many times over. Budgets count the same tokens per UTC day and calendar month,
start again at the period's start, and are rebuilt from the usage ledger at start (:func:`restore_budgets`). The
clock is injected (wall-clock seconds), so tests move it.

The state lives per key name and survives reloads: a key whose limits change keeps what it used.

With worker processes the control process holds every key's quota for all of them (:meth:`Quotas.absorb`):
each worker reports what its keys used, at most :data:`~gateway.control.worker_link.REPORT_INTERVAL_S` late,
and the control sends every worker the sums (:meth:`Quotas.snapshot`, :meth:`Quotas.apply`). Between two such
rounds a worker may use only its share (1/N) of what the bucket held, so the workers together never admit more
requests than the limit; a burst on one worker may be refused early, until the next round hands it the rest.
Budgets and concurrency are checked against the sums as of the last round (they may be passed by what the
other workers admitted since, ~150 ms).

Replicas on several hosts (``gateway.replicas.shared``) use the same reports, exchanged through a shared store
instead of a control process: :mod:`gateway.tenants.shared_quotas`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loguru import logger

from gateway.config import KeyLimits

Clock = Callable[[], float]


@dataclass(slots=True)
class Bucket:
    """``capacity`` units, refilled at ``capacity`` per ``period_s``; the level may go below zero (charged after).

    ``scale``: the part of it this process holds (1/N in each of N worker processes): its level, top and refill
    are that part of the key's, while ``remaining`` speaks for the whole key. ``top`` and ``per_s`` are kept as
    fields (set from ``capacity``): every request of a limited key reads them."""

    capacity: int
    at: float  # when the level was last brought up to date
    period_s: float = 60.0
    scale: float = 1.0
    level: float = field(default=math.nan)  # starts full
    top: float = field(init=False, repr=False)  # this process's part of the capacity
    per_s: float = field(init=False, repr=False)  # refill rate of that part
    capacity_text: bytes = field(init=False, repr=False)  # the capacity as the rate-limit headers write it

    def __post_init__(self) -> None:
        self._set_rates()
        if math.isnan(self.level):
            self.level = self.top

    def _set_rates(self) -> None:
        self.top = self.capacity * self.scale
        self.per_s = self.top / self.period_s
        self.capacity_text = b"%d" % self.capacity

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.top, self.level + (now - self.at) * self.per_s)
            self.at = now

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self._set_rates()
        self.level = min(self.level, self.top)

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.level / self.scale + 1e-9))

    def wait_s(self, need: float = 1.0) -> float:
        """Seconds until the level reaches ``need``."""
        return max(0.0, (need - self.level) / self.per_s)

    def full_in_s(self) -> float:
        """Seconds until the bucket is full again (what the rate-limit reset headers say)."""
        missing = self.top - self.level
        return missing / self.per_s if missing > 0 else 0.0


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
    until: float = field(default=-math.inf, repr=False)  # the next period's start (when ``since`` was computed)
    base: int = 0  # ``used`` as of the control's last round (worker processes): this process holds a share of what was left

    def fits(self, tokens: int, share: float) -> bool:
        """Whether a reservation of ``tokens`` fits this process's share of what was left at the last round."""
        return (self.used - self.base) + tokens <= (self.limit - self.base) * share

    def roll(self, now: float) -> None:
        if self.since <= now < self.until:  # the hot path: still in the same period (no calendar arithmetic)
            return
        start = period_start(now, self.period)
        if start != self.since:
            self.since, self.used, self.base = start, 0, 0
        self.until = next_period_start(now, self.period)


@dataclass(frozen=True)
class Refusal:
    """Why a request of this key is refused now, and when to retry."""

    message: str
    code: str
    retry_after_s: float


@dataclass(frozen=True)
class QuotaView:
    """One key's quota as the control process sends it to its workers (the sums over all of them)."""

    requests_level: float | None
    tokens_level: float | None
    at: float
    day_used: int
    month_used: int
    in_flight: tuple[tuple[int, int], ...]  # (worker index, its requests of this key in flight)
    held: tuple[tuple[int, int], ...] = ()  # (worker index, the tokens its requests of this key hold now)


class KeyQuota:
    """One key's limits and what it used."""

    def __init__(self, limits: KeyLimits, now: float, share: float = 1.0) -> None:
        self.limits = KeyLimits()
        self.requests: Bucket | None = None
        self.tokens: Bucket | None = None
        self.day: Budget | None = None
        self.month: Budget | None = None
        self.in_flight = 0
        self.share = share  # of the buckets, for one worker of several (1: the process holds the whole quota)
        self.others_in_flight = 0  # the other workers' requests of this key, as of the last round
        self.others_held = 0  # the tokens the other workers' requests of this key hold, as of the last round
        self.unreported = [0, 0]  # requests admitted and tokens charged here since the last report
        self.reported_in_flight = 0
        self.reserved = 0  # tokens held by this process's requests in flight (charged at admission, settled at the end)
        self.update(limits, now)

    def update(self, limits: KeyLimits, now: float) -> None:
        """Take new limits (a reload), keeping what was used under the old ones."""
        if limits == self.limits:
            self.limits = limits  # the same limits: the next look at them is an identity check
            return
        self.limits = limits
        self.requests = _bucket(self.requests, limits.requests_per_minute, now, self.share)
        self.tokens = _bucket(self.tokens, limits.tokens_per_minute, now, self.share)
        self.day = _budget(self.day, limits.tokens_per_day, "day", now)
        self.month = _budget(self.month, limits.tokens_per_month, "month", now)

    def admit(self, now: float) -> Refusal | None:
        """Take one request (None), or say why not; an admitted request must be given back by :meth:`finish`."""
        limits = self.limits
        in_flight = self.in_flight + self.others_in_flight
        if limits.max_concurrent is not None and in_flight >= limits.max_concurrent:
            return Refusal(f"this key has {in_flight} requests in flight, its limit", "too_many_concurrent_requests", 1.0)
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
                if budget.used - self.reserved - self.others_held >= budget.limit:  # spent, not held by requests in flight
                    wait = next_period_start(now, budget.period) - now
                    return Refusal(f"token budget spent: {budget.limit} tokens per {budget.period}", "insufficient_quota", wait)
        if self.requests is not None:
            self.requests.level -= 1
        self.in_flight += 1
        self.unreported[0] += 1
        return None

    def reserve(self, tokens: int, now: float) -> Refusal | None:
        """Hold ``tokens`` (what an admitted request may cost at most) against the token bucket and the budgets, or
        say why not. A reservation that does not fit what is left is refused, unless this key has no other
        reservation here: a request larger than a whole limit still runs alone (the bound on the overshoot)."""
        limits = self.limits
        alone = self.reserved == 0 and self.others_in_flight == 0
        if self.tokens is not None and not alone:
            self.tokens.refill(now)
            if tokens > self.tokens.level:
                wait = self.tokens.wait_s(tokens) if tokens <= self.tokens.top else self.tokens.full_in_s()
                return Refusal(f"rate limit reached: {limits.tokens_per_minute} tokens per minute (this request may use {tokens})", "rate_limit_exceeded", max(wait, 0.001))
        for budget in (self.day, self.month):
            if budget is not None and not alone:
                budget.roll(now)
                whole = self.reserved == 0 and budget.used + tokens <= budget.limit  # this process's one request may take all that was left
                if not whole and not budget.fits(tokens, self.share):  # not spent (admit says so): held by requests in flight
                    left = max(0, budget.limit - budget.used)
                    return Refusal(f"token budget: {left} of {budget.limit} tokens per {budget.period} left or held by requests in flight; this request may use {tokens}", "rate_limit_exceeded", 1.0)
        self.reserved += tokens
        self.unreported[1] += tokens
        self.charge(tokens, now)
        return None

    def finish(self, tokens: int, now: float, reserved: int = 0) -> None:
        """An admitted request ended, having used ``tokens`` (prompt + completion); ``reserved``: what it held."""
        self.in_flight = max(0, self.in_flight - 1)
        self.reserved = max(0, self.reserved - reserved)
        settle = tokens - reserved
        if settle == 0:
            return
        self.unreported[1] += settle
        self.charge(settle, now)

    def charge(self, tokens: int, now: float) -> None:
        """Count ``tokens`` against the token bucket and the budgets."""
        if self.tokens is not None:
            self.tokens.refill(now)
            self.tokens.level -= tokens
        for budget in (self.day, self.month):
            if budget is not None:
                budget.roll(now)
                budget.used += tokens


def _bucket(old: Bucket | None, capacity: int | None, now: float, share: float) -> Bucket | None:
    if capacity is None:
        return None
    if old is None:
        return Bucket(capacity, at=now, scale=share)
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

    def __init__(self, clock: Clock = time.time, share: float = 1.0) -> None:
        self.clock = clock
        self.share = share  # 1/N in each of N worker processes
        self._by_name: dict[str, KeyQuota] = {}
        # a worker's reports the control had not counted yet in the last sums it sent: (number, key -> used)
        self._unabsorbed: list[tuple[int, dict[str, tuple[int, int]]]] = []
        self._reports = 0
        # the control's view: key -> worker -> in flight (and tokens held), and the last report of each worker it counted
        self._in_flight: dict[str, dict[int, int]] = {}
        self._held: dict[str, dict[int, int]] = {}
        self.absorbed: dict[int, int] = {}
        self._spent: dict[str, dict[str, int]] = {"day": {}, "month": {}}  # from the ledger at start: key -> tokens

    def restore(self, period: str, spent: dict[str, int]) -> None:
        """Take what each key spent in the current ``period`` (``day`` or ``month``) as the ledger says at start:
        a restarted gateway goes on from there instead of granting a fresh budget."""
        self._spent[period] = dict(spent)
        for name, quota in self._by_name.items():
            budget = quota.day if period == "day" else quota.month
            if budget is not None:
                budget.used = max(budget.used, spent.get(name, 0))

    def of(self, name: str, limits: KeyLimits) -> KeyQuota:
        """The quota of key ``name``, brought to ``limits`` (those in force now)."""
        quota = self._by_name.get(name)
        if quota is None:
            quota = self._by_name[name] = KeyQuota(limits, self.clock(), self.share)
            for budget, period in ((quota.day, "day"), (quota.month, "month")):
                if budget is not None:
                    budget.used = self._spent[period].get(name, 0)
        elif quota.limits is not limits:  # a reload made new limits (an equal model keeps the quota as it is)
            quota.update(limits, self.clock())
        return quota

    # ----------------------------------------------------------------- a worker's side
    def report(self) -> tuple[int, dict[str, tuple[int, int, int, int]]] | None:
        """What each key used here since the last report (requests admitted, tokens charged, in flight now, tokens its
        requests in flight hold now), numbered; None when nothing changed."""
        used = {}
        for name, quota in self._by_name.items():
            requests, tokens = quota.unreported
            if requests or tokens or quota.in_flight != quota.reported_in_flight:
                used[name] = (requests, tokens, quota.in_flight, quota.reserved)
                quota.reported_in_flight = quota.in_flight
            quota.unreported = [0, 0]
        if not used:
            return None
        self._reports += 1
        self._unabsorbed.append((self._reports, {name: (counts[0], counts[1]) for name, counts in used.items()}))
        return self._reports, used

    def apply(self, views: dict[str, tuple[KeyLimits, QuotaView]], worker: int, absorbed: int) -> None:
        """Take the sums the control sent (having counted this worker's reports up to ``absorbed``): this worker's
        share of what the buckets hold, less what it used that the sums do not hold yet."""
        now = self.clock()
        self._unabsorbed = [(number, used) for number, used in self._unabsorbed if number > absorbed]
        for name, (limits, view) in views.items():
            quota = self.of(name, limits)
            requests, tokens = quota.unreported
            for _, used in self._unabsorbed:
                requests, tokens = requests + used.get(name, (0, 0))[0], tokens + used.get(name, (0, 0))[1]
            if quota.requests is not None and view.requests_level is not None:
                quota.requests.level, quota.requests.at = view.requests_level * self.share - requests, view.at
                quota.requests.refill(now)
            if quota.tokens is not None and view.tokens_level is not None:
                quota.tokens.level, quota.tokens.at = view.tokens_level * self.share - tokens, view.at
                quota.tokens.refill(now)
            for budget, total in ((quota.day, view.day_used), (quota.month, view.month_used)):
                if budget is not None:
                    budget.roll(now)
                    budget.used, budget.base = total + tokens, total
            quota.others_in_flight = sum(count for index, count in view.in_flight if index != worker)
            quota.others_held = sum(count for index, count in view.held if index != worker)

    def counted(self, number: int) -> None:
        """The sums hold this process's reports up to ``number`` (a replica counts its own at once, whether or not the
        next :meth:`apply` comes soon): they are no longer kept to be subtracted from it."""
        self._unabsorbed = [(seen, used) for seen, used in self._unabsorbed if seen > number]

    def on_its_own(self) -> None:
        """No sums will come for a while (replicas whose shared store is unreachable): besides its share of each bucket
        and of what each budget had left, each key's concurrency is held to this process's share of its limit (at least
        one request), instead of the other processes' counts as of the last round."""
        for quota in self._by_name.values():
            limit = quota.limits.max_concurrent
            quota.others_in_flight = 0 if limit is None else limit - max(1, math.floor(limit * self.share))

    # ----------------------------------------------------------------- the control's side
    def absorb(self, worker: int, number: int, used: dict[str, tuple[int, ...]], limits: dict[str, KeyLimits]) -> None:
        """Count report ``number`` of worker ``worker`` (key -> used: requests, tokens, in flight, and tokens held: a
        report of an older replica has no held); ``limits``: the limited named keys in force."""
        now = self.clock()
        for name, counts in used.items():
            requests, tokens, in_flight = counts[:3]
            held = counts[3] if len(counts) > 3 else 0
            key_limits = limits.get(name)
            if key_limits is None:  # no longer limited (a reload): nothing to count
                continue
            quota = self.of(name, key_limits)
            if quota.requests is not None:
                quota.requests.refill(now)
                quota.requests.level -= requests
            if tokens:
                quota.charge(tokens, now)
            self._in_flight.setdefault(name, {})[worker] = in_flight
            self._held.setdefault(name, {})[worker] = held
        self.absorbed[worker] = number

    def forget_worker(self, worker: int) -> None:
        """A worker that exited has nothing in flight any more, and its successor numbers its reports from 1."""
        for counts in (*self._in_flight.values(), *self._held.values()):
            counts.pop(worker, None)
        self.absorbed.pop(worker, None)

    def snapshot(self, limits: dict[str, KeyLimits]) -> dict[str, tuple[KeyLimits, QuotaView]]:
        """What every worker gets: the sums, per key of ``limits`` (the limited named keys in force)."""
        views = {}
        for name, key_limits in limits.items():
            quota = self.of(name, key_limits)
            for budget in (quota.day, quota.month):
                if budget is not None:
                    budget.roll(self.clock())
            at = max((b.at for b in (quota.requests, quota.tokens) if b is not None), default=0.0)
            views[name] = (key_limits, QuotaView(
                quota.requests.level if quota.requests is not None else None,
                quota.tokens.level if quota.tokens is not None else None,
                at,
                quota.day.used if quota.day is not None else 0,
                quota.month.used if quota.month is not None else 0,
                tuple(sorted(self._in_flight.get(name, {}).items())),
                tuple(sorted(self._held.get(name, {}).items())),
            ))  # fmt: skip
        return views


class _SpentReader(Protocol):
    async def spent_since(self, since: dt.datetime) -> dict[str, int]: ...


async def restore_budgets(quotas: Quotas, ledger: _SpentReader) -> None:
    """Day and month budgets from the ledger (the process that holds the sums does it once, at start)."""
    now = quotas.clock()
    for period in ("day", "month"):
        since = dt.datetime.fromtimestamp(period_start(now, period), dt.UTC)
        quotas.restore(period, await ledger.spent_since(since))


async def restore_budgets_when_readable(quotas: Quotas, ledger: _SpentReader, retry_s: float = 5.0) -> asyncio.Task[None] | None:
    """:func:`restore_budgets` now; a ledger that cannot be read fails no start: said in one line, then tried again
    every ``retry_s`` in a task (returned, for the caller to cancel at stop) until it answers. Meanwhile a budget
    counts from what this process has seen since its start."""
    try:
        await restore_budgets(quotas, ledger)
        return None
    except Exception as error:  # noqa: BLE001 - the database down at start
        logger.error(
            "usage ledger: cannot read what keys spent this day and month ({}: {}); budgets count from this start until it "
            "can, tried again every {:g} s", type(error).__name__, str(error).splitlines()[0][:200], retry_s,
        )  # fmt: skip

    async def retry() -> None:
        while True:
            await asyncio.sleep(retry_s)
            try:
                await restore_budgets(quotas, ledger)
            except Exception:  # noqa: BLE001,S112 - still down: said once already
                continue
            logger.info("usage ledger: readable again; the day and month budgets are restored from it")
            return

    return asyncio.create_task(retry(), name="restore budgets")
