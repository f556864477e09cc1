"""What a checked task is, as this package reads it: the pipeline's task kinds and the fields of
its step (the pipeline's :class:`~relay_server.pipeline.ledger.Step` has them; this package sits
below the pipeline and names only what it reads)."""

from __future__ import annotations

from typing import Protocol

FIRST, FORWARD, LAST, BACKWARD = "first", "forward", "last", "backward"


class StepLike(Protocol):
    @property
    def kind(self) -> str: ...

    @property
    def stage(self) -> int: ...

    @property
    def microbatch(self) -> int: ...

    @property
    def batch(self) -> int: ...

    @property
    def redo(self) -> bool: ...

    def inputs(self) -> list[str]: ...


def output_name(step: StepLike) -> str | None:
    """The boundary a task's result gives (``a{k}`` of a forward, ``g{k-1}`` of a backward), None
    for a task whose result holds no boundary (stage 0's backward, a redo): nothing to compare."""
    if step.kind in (FIRST, FORWARD):
        return f"a{step.stage}"
    if step.redo or step.stage == 0:
        return None
    return f"g{step.stage - 1}"
