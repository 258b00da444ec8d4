"""Restart backoff: doubling from 1 s, capped at 60 s, reset by 5 minutes of health."""

from xinserve.server.pool.restart_policy import RestartBackoff


def test_delays_double_up_to_the_cap():
    backoff = RestartBackoff()
    assert [backoff.next_delay(0) for _ in range(9)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def test_short_healthy_spells_do_not_reset_the_streak():
    backoff = RestartBackoff()
    assert [backoff.next_delay(10) for _ in range(4)] == [1, 2, 4, 8]
    assert backoff.next_delay(299.9) == 16


def test_five_healthy_minutes_start_again_from_one_second():
    backoff = RestartBackoff()
    for _ in range(20):
        backoff.next_delay(0)
    assert backoff.next_delay(300) == 1
    assert backoff.next_delay(0) == 2


def test_the_streak_stops_growing_at_the_cap():
    backoff = RestartBackoff(first_s=1, cap_s=8)
    for _ in range(10_000):
        backoff.next_delay(0)
    assert backoff.streak == 3 and backoff.next_delay(0) == 8
