"""The per-key quota arithmetic, on a clock the test moves: buckets, budgets and what a reload keeps."""

from __future__ import annotations

from gateway.config import KeyLimits
from gateway.edge.quota import duration
from gateway.tenants.quotas import Bucket, KeyQuota, Quotas, QuotaView, next_period_start, period_start

JAN_1 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def test_a_bucket_refills_continuously_up_to_its_capacity() -> None:
    bucket = Bucket(60, at=0.0)
    assert bucket.level == 60 and bucket.per_s == 1.0
    bucket.level -= 61  # charged after: below zero
    assert bucket.remaining == 0 and bucket.wait_s() == 2.0
    bucket.refill(30.0)
    assert bucket.level == 29 and bucket.full_in_s() == 31.0
    bucket.refill(10.0)  # a clock going back changes nothing
    assert bucket.level == 29
    bucket.refill(1000.0)
    assert bucket.level == 60


def test_periods_follow_the_utc_calendar() -> None:
    assert period_start(JAN_1 + 3600, "day") == JAN_1 and next_period_start(JAN_1 + 3600, "day") == JAN_1 + 86400
    assert period_start(JAN_1 - 1, "month") == JAN_1 - 31 * 86400  # 2025-12-01
    assert next_period_start(JAN_1 - 1, "month") == JAN_1  # December rolls over to the next year
    assert next_period_start(JAN_1, "month") == JAN_1 + 31 * 86400  # 2026-02-01


def test_a_spent_budget_lasts_until_its_period_ends_and_not_a_second_longer() -> None:
    quota = KeyQuota(KeyLimits(tokens_per_day=100, tokens_per_month=250), JAN_1 + 10)
    assert quota.admit(JAN_1 + 10) is None
    quota.finish(100, JAN_1 + 20)
    for now in (JAN_1 + 30, JAN_1 + 86399.5):
        refused = quota.admit(now)
        assert refused is not None and refused.code == "insufficient_quota" and "per day" in refused.message
        assert refused.retry_after_s == JAN_1 + 86400 - now
    assert quota.admit(JAN_1 + 86400) is None  # the next UTC day: a fresh daily budget, the month keeps counting
    quota.finish(150, JAN_1 + 86400)
    assert quota.day is not None and quota.day.used == 150 and quota.month is not None and quota.month.used == 250
    refused = quota.admit(JAN_1 + 2 * 86400)
    assert refused is not None and "per month" in refused.message
    assert quota.admit(JAN_1 + 31 * 86400) is None  # February


def test_admission_order_and_what_finish_gives_back() -> None:
    quota = KeyQuota(KeyLimits(max_concurrent=2, requests_per_minute=10, tokens_per_minute=100), JAN_1)
    assert quota.admit(JAN_1) is None and quota.admit(JAN_1) is None
    refused = quota.admit(JAN_1)
    assert refused is not None and refused.code == "too_many_concurrent_requests" and refused.retry_after_s == 1.0
    quota.finish(150, JAN_1)
    quota.finish(0, JAN_1)
    assert quota.in_flight == 0 and quota.tokens is not None and quota.tokens.level == -50
    refused = quota.admit(JAN_1)
    assert refused is not None and refused.code == "rate_limit_exceeded" and "tokens per minute" in refused.message
    assert round(refused.retry_after_s, 6) == 30.6  # until the bucket holds one token again: 51 at 100 a minute
    assert quota.requests is not None and quota.requests.level == 8  # a refused request takes nothing


def test_a_reload_keeps_what_a_key_used() -> None:
    quotas = Quotas(clock=lambda: JAN_1)
    first = quotas.of("t", KeyLimits(requests_per_minute=10, tokens_per_day=1000))
    for _ in range(4):
        assert first.admit(JAN_1) is None
        first.finish(100, JAN_1)
    again = quotas.of("t", KeyLimits(requests_per_minute=5, tokens_per_day=2000))
    assert again is first and again.requests is not None and again.requests.level == 5  # 6 left, capped to the new 5
    assert again.day is not None and again.day.used == 400 and again.day.limit == 2000
    assert quotas.of("t", KeyLimits(requests_per_minute=5)).day is None  # a limit taken away


def test_reset_durations_read_like_openais() -> None:
    assert [duration(s) for s in (0.25, 1.0, 1.52, 59.9, 60.0, 90.2, 3600.0)] == ["250ms", "1s", "1.6s", "59.9s", "1m0s", "1m31s", "60m0s"]


def test_workers_share_a_key_through_the_controls_rounds() -> None:
    limits = KeyLimits(requests_per_minute=10, tokens_per_day=1000, max_concurrent=6)
    control, workers = Quotas(clock=lambda: JAN_1), [Quotas(clock=lambda: JAN_1, share=0.5) for _ in range(2)]
    a, b = (worker.of("t", limits) for worker in workers)
    assert [a.admit(JAN_1) is None for _ in range(6)] == [True] * 5 + [False]  # half of the bucket before any round

    def round_trip() -> None:
        for index, worker in enumerate(workers):
            report = worker.report()
            if report is not None:
                control.absorb(index, *report, {"t": limits})
        views = control.snapshot({"t": limits})
        for index, worker in enumerate(workers):
            worker.apply(views, index, control.absorbed.get(index, 0))

    round_trip()  # a used 5 of 10: each now holds half of the 5 left
    assert a.requests is not None and b.requests is not None and a.requests.level == b.requests.level == 2.5
    assert a.others_in_flight == 0 and b.others_in_flight == 5
    assert b.admit(JAN_1) is None
    refused = b.admit(JAN_1)  # 5 in flight on a, 1 here: the key's 6
    assert refused is not None and refused.code == "too_many_concurrent_requests"
    for _ in range(5):
        a.finish(100, JAN_1)
    round_trip()
    assert b.day is not None and b.day.used == 500 and b.others_in_flight == 0  # a's tokens count for b too
    assert a.requests.level == b.requests.level == 2.0  # 10 - 6, shared
    assert [b.admit(JAN_1) is None for _ in range(3)] == [True, True, False]
    views = control.snapshot({"t": limits})  # sums made before b's last report was counted: b still counts its own
    b_report = workers[1].report()
    workers[1].apply(views, 1, control.absorbed.get(1, 0))
    assert b.requests.level == 0.0 and b_report is not None
    control.absorb(1, *b_report, {"t": limits})
    round_trip()
    assert a.requests.level == b.requests.level == 1.0  # 10 - 8, shared


def test_reservations_hold_a_budget_under_concurrency_and_settle_with_the_real_use() -> None:
    quota = KeyQuota(KeyLimits(tokens_per_day=300, tokens_per_minute=1000), JAN_1)
    held = []
    for _ in range(20):  # 20 requests admitted at once, each of which may cost 120
        if quota.admit(JAN_1) is None:
            refused = quota.reserve(120, JAN_1)
            if refused is None:
                held.append(120)
            else:
                assert refused.code == "rate_limit_exceeded" and "may use 120" in refused.message and refused.retry_after_s == 1.0
                quota.finish(0, JAN_1)
    assert held == [120, 120] and quota.day is not None and quota.day.used == 240
    quota.finish(30, JAN_1, reserved=120)  # settled: what it held back, its real use kept
    assert quota.day.used == 150 and quota.reserved == 120 and quota.tokens is not None and quota.tokens.level == 850
    quota.finish(30, JAN_1, reserved=120)
    assert quota.day.used == 60 and quota.reserved == 0
    assert quota.admit(JAN_1) is None and quota.reserve(5000, JAN_1) is None  # alone: larger than a limit, it still runs
    assert quota.reserve(1, JAN_1) is not None  # but nothing beside it


def test_a_worker_reserves_only_its_share_of_what_was_left() -> None:
    quota = KeyQuota(KeyLimits(tokens_per_day=300), JAN_1, share=0.5)
    assert quota.admit(JAN_1) is None and quota.reserve(100, JAN_1) is None
    assert quota.admit(JAN_1) is None and quota.reserve(100, JAN_1) is not None  # 200 > its half of 300


def test_budgets_restored_from_the_ledger_apply_to_keys_made_before_and_after() -> None:
    quotas = Quotas(clock=lambda: JAN_1 + 60)
    limits = KeyLimits(tokens_per_day=300, tokens_per_month=1000)
    early = quotas.of("early", limits)
    quotas.restore("day", {"early": 310, "late": 120})
    quotas.restore("month", {"late": 900})
    assert early.day is not None and early.day.used == 310 and early.admit(JAN_1 + 60) is not None
    late = quotas.of("late", limits)
    assert late.day is not None and late.month is not None and (late.day.used, late.month.used) == (120, 900)


def test_on_its_own_a_process_keeps_its_share_of_a_keys_concurrency() -> None:
    """Replicas whose shared store is unreachable: the others' last counts give way to this process's share."""
    quotas = Quotas(clock=lambda: JAN_1, share=0.5)
    quota = quotas.of("t", KeyLimits(max_concurrent=5))
    odd = quotas.of("u", KeyLimits(max_concurrent=1))
    free = quotas.of("v", KeyLimits(requests_per_minute=10))
    quota.others_in_flight = odd.others_in_flight = 5  # as of the last round
    quotas.on_its_own()
    assert (quota.others_in_flight, odd.others_in_flight, free.others_in_flight) == (3, 0, 0)  # 2 of 5 here, at least 1
    assert [quota.admit(JAN_1) is None for _ in range(3)] == [True, True, False]


def test_reports_the_sums_hold_are_not_subtracted_again() -> None:
    """A replica puts its own report in its sums at once (counted): the next apply takes its share of sums that
    already hold it, not less again (and a store down for long keeps no list of reports)."""
    limits = KeyLimits(requests_per_minute=10)
    for counted, level in ((True, 4.0), (False, 2.0)):
        quotas = Quotas(clock=lambda: JAN_1, share=0.5)
        quota = quotas.of("t", limits)
        assert quota.admit(JAN_1) is None and quota.admit(JAN_1) is None
        report = quotas.report()
        assert report is not None
        if counted:
            quotas.counted(report[0])
        quotas.apply({"t": (limits, QuotaView(8.0, None, JAN_1, 0, 0, ()))}, 0, 0)  # sums: 10 - the 2 admitted here
        assert quota.requests is not None and quota.requests.level == level


def test_a_hold_in_flight_is_not_a_spent_budget() -> None:
    """300 tokens a day, one request holding 520 that will cost 55. Another request meanwhile is
    told the budget is held (rate_limit_exceeded, retry in 1 s), not spent until midnight; once the hold is settled
    it runs; only the tokens really used spend the budget."""
    quota = KeyQuota(KeyLimits(tokens_per_day=300), JAN_1 + 60)
    assert quota.admit(JAN_1 + 60) is None and quota.reserve(520, JAN_1 + 60) is None  # alone: larger than the budget, it runs
    assert quota.admit(JAN_1 + 61) is None  # held, not spent: admitted
    refused = quota.reserve(40, JAN_1 + 61)
    assert refused is not None and refused.code == "rate_limit_exceeded" and refused.retry_after_s == 1.0, refused
    quota.finish(0, JAN_1 + 61)
    quota.finish(55, JAN_1 + 62, reserved=520)
    assert quota.admit(JAN_1 + 63) is None and quota.reserve(40, JAN_1 + 63) is None
    quota.finish(245, JAN_1 + 64, reserved=40)  # 300 spent
    refused = quota.admit(JAN_1 + 65)
    assert refused is not None and refused.code == "insufficient_quota" and refused.retry_after_s == 86400 - 65


def test_what_another_workers_requests_hold_is_not_spent_either() -> None:
    limits = KeyLimits(tokens_per_day=300)
    control, workers = Quotas(clock=lambda: JAN_1), [Quotas(clock=lambda: JAN_1, share=0.5) for _ in range(2)]
    a, b = (worker.of("t", limits) for worker in workers)
    assert a.admit(JAN_1) is None and a.reserve(520, JAN_1) is None
    for index, worker in enumerate(workers):
        report = worker.report()
        if report is not None:
            control.absorb(index, *report, {"t": limits})
    views = control.snapshot({"t": limits})
    for index, worker in enumerate(workers):
        worker.apply(views, index, control.absorbed.get(index, 0))
    assert b.day is not None and b.day.used == 520 and b.others_held == 520
    assert b.admit(JAN_1) is None  # the other worker's hold: not spent
    refused = b.reserve(40, JAN_1)
    assert refused is not None and refused.code == "rate_limit_exceeded"


def test_replicas_store_what_is_held_apart_from_the_counts_older_replicas_read() -> None:
    from gateway.tenants.shared_quotas import _read, _written

    stored = _written({"t": [2, 600, 1, 520], "u": [1, 5, 0, 0]})
    assert all(len(counts) == 3 for counts in stored.values())  # what an older replica destructures
    assert _read(stored) == {"t": (2, 600, 1, 520), "u": (1, 5, 0, 0)}
    assert _read({"t": [2, 600, 1]}) == {"t": (2, 600, 1, 0)}  # an older replica's report
