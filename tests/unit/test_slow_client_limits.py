"""The receiver's file descriptor limit fits HTTP_LIMIT_CONCURRENCY where it can, and says
so where it cannot (services/receiver/deadlines.py)."""

from __future__ import annotations

import logging
import resource

import pytest

from services.receiver import deadlines


def limits(monkeypatch, soft: int, hard: int) -> list[tuple[int, int]]:
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(deadlines.resource, "getrlimit", lambda _: (soft, hard))
    monkeypatch.setattr(deadlines.resource, "setrlimit", lambda _, value: set_to.append(value))
    return set_to


def test_a_soft_descriptor_limit_below_the_concurrency_is_raised_to_fit_it(monkeypatch) -> None:
    set_to = limits(monkeypatch, 1024, 65536)
    assert deadlines.fit_file_descriptors(2000) == 2000 + deadlines.OTHER_DESCRIPTORS
    assert set_to == [(2000 + deadlines.OTHER_DESCRIPTORS, 65536)]


def test_a_hard_descriptor_limit_below_the_concurrency_is_reached_and_warned_of(
    monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    set_to = limits(monkeypatch, 256, 1024)
    with caplog.at_level(logging.WARNING):
        assert deadlines.fit_file_descriptors(1000) == 1024
    assert set_to == [(1024, 1024)]
    assert "CHATQ_HTTP_LIMIT_CONCURRENCY=1000" in caplog.text


def test_a_descriptor_limit_that_already_fits_is_left_alone(monkeypatch) -> None:
    set_to = limits(monkeypatch, 20000, resource.RLIM_INFINITY)
    assert deadlines.fit_file_descriptors(1000) == 20000
    assert set_to == []
