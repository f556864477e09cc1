"""Hypothesis properties run twice: a few examples in the default suite, many under ``-m slow``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings


def twin_property(check: Callable[..., None], fast: int, slow: int, **strategies: Any) -> tuple[Callable, Callable]:
    """The same property as a default-run test (``fast`` examples) and a ``slow`` twin (``slow``)."""

    def variant(n: int) -> Callable:
        return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)(
            given(**strategies)(check)
        )

    return variant(fast), pytest.mark.slow(variant(slow))
