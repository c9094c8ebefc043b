"""When a local cluster restarts a stage that exited: the backoff as plain numbers, no waiting."""

from __future__ import annotations

import pytest

from mlxppd.core.restart_policy import RestartDecision, RestartPolicy


def delays(policy: RestartPolicy, served: list[float]) -> list[float | None]:
    """The delay chosen after each exit, the stage having served ``served[i]`` seconds."""
    failed, out = 0, []
    for s in served:
        decision = policy.after_exit(failed, s)
        failed = decision.failed_starts
        out.append(decision.delay_s)
    return out


def test_a_crash_loop_backs_off_doubling_to_the_cap_then_gives_up() -> None:
    policy = RestartPolicy()  # 0.5 s doubling to 10 s, give up after 10 failed starts
    assert delays(policy, [0.0] * 10) == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 10.0, None]


def test_a_stage_that_served_long_enough_starts_the_count_afresh() -> None:
    policy = RestartPolicy()
    assert delays(policy, [1.0, 1.0, 1.0, 60.0, 1.0, 59.9]) == [0.5, 1.0, 2.0, 0.5, 0.5, 1.0]
    assert policy.after_exit(9, 60.0) == RestartDecision(0, 0.5)
    assert policy.after_exit(9, 59.9) == RestartDecision(10, None)


def test_a_healthy_stage_that_crashes_now_and_then_is_always_restarted() -> None:
    assert delays(RestartPolicy(), [3600.0] * 50) == [0.5] * 50


def test_the_numbers_are_configurable() -> None:
    policy = RestartPolicy(
        first_delay_s=1.0, max_delay_s=3.0, healthy_after_s=5.0, max_failed_starts=4
    )
    assert delays(policy, [0.0, 4.0, 4.9, 4.0]) == [1.0, 2.0, 3.0, None]
    assert delays(policy, [0.0, 5.0, 0.0]) == [1.0, 1.0, 1.0]


def test_one_allowed_failure_gives_up_at_once() -> None:
    assert RestartPolicy(max_failed_starts=1).after_exit(0, 0.0) == RestartDecision(1, None)


def test_a_huge_failure_count_does_not_overflow() -> None:
    policy = RestartPolicy(max_failed_starts=10**6)
    assert policy.after_exit(5000, 0.0) == RestartDecision(5001, 10.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"first_delay_s": -1.0},
        {"first_delay_s": 11.0},
        {"healthy_after_s": -1.0},
        {"max_failed_starts": 0},
    ],
)
def test_nonsense_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**bad)  # type: ignore[arg-type]
