"""The tests' one fake clock: a test moves it by hand, code under test reads it as ``clock=``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Clock:
    """A clock a test moves by hand (``clock.now += 5``): pass it where code takes ``clock=``."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now
