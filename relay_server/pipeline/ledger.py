"""One batch of the pipeline as a state machine: which task each micro-batch needs next, and who
holds which stage's gradient of which micro-batch (the exactly-once ledger).

A micro-batch ``m`` of a ``K``-stage pipeline goes ``first`` (stage 0) -> ``forward`` (stages 1 ..
K-2) -> ``last`` (stage K-1: forward, loss and backward at once, as 1F1B does) -> ``backward``
(stages K-2 .. 0, each recomputing its forward from the stored input). At most one of these is in
the task pool at a time per micro-batch, so a result names exactly what comes next.

**Exactly once.** A stage's parameter gradient of ``m`` is counted by whichever worker's result
for that stage's ``last``/``backward`` task the relay *accepted* (:meth:`Ledger.accept` is called
once per task; a second result for the same task is refused before it gets here, and the worker
that sent it drops that gradient). Those owners upload in the batch's round; a micro-batch counts
for stage ``k`` once its owner's upload reached the stage's parameter server. An owner that leaves
before that makes its micro-batches *orphans* for its stage: a ``redo`` task recomputes only that
stage's parameter gradient (from the input and output gradient the relay still holds), and its
worker becomes the owner. So every stage's round counts exactly the batch's samples, whatever died
on the way, and the round opens only when every micro-batch finished its backward.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

FIRST, FORWARD, LAST, BACKWARD = "first", "forward", "last", "backward"


@dataclass(frozen=True)
class Step:
    """A task to put in the pool: ``kind`` of stage ``stage`` for micro-batch ``microbatch``."""

    kind: str
    stage: int
    microbatch: int
    prefer: str | None = None
    """The worker that ran this stage's forward of the micro-batch (it may hold the input)."""
    redo: bool = False
    batch: int = 0
    """The batch (its :class:`Ledger`) the micro-batch belongs to: with delayed parameter updates
    two batches are in flight, one closing its round while the next computes."""

    def inputs(self) -> list[str]:
        """The boundary entries the task needs (:mod:`.boundaries` names)."""
        if self.kind == FIRST:
            return []  # the worker reads a micro-batch of its own data
        stage_input = "batch" if self.stage == 0 else f"a{self.stage - 1}"
        if self.kind == FORWARD:
            return [stage_input]
        if self.kind == LAST:
            return [stage_input, "batch"]  # the labels
        return [stage_input, f"g{self.stage}"]  # a backward recomputes from the stored input


@dataclass
class MicroBatch:
    index: int
    forward_workers: dict[int, str] = field(default_factory=dict)
    owners: dict[int, str] = field(default_factory=dict)
    """stage -> the worker whose accepted result holds that stage's gradient of this micro-batch."""
    delivered: set[int] = field(default_factory=set)
    """Stages whose gradient of this micro-batch reached the stage's parameter server."""
    rows: int | None = None
    """Rows of every boundary matrix ([samples x tokens, width]), fixed by the first stage."""
    loss_sum: float | None = None
    finished: bool = False
    """Every stage's backward ran (its gradients may still be on their way up)."""


class Ledger:
    """One batch in flight: ``microbatches`` ids, each at some point of its path, every task
    computed on the parameters of ``version`` (``batch`` itself, or with delayed parameter updates
    ``batch - 1``: fixed when the batch is minted, never by timing)."""

    def __init__(self, batch: int, version: int, num_stages: int, first_id: int, count: int) -> None:
        self.batch, self.version, self.num_stages = batch, version, num_stages
        self.microbatches = {m: MicroBatch(m) for m in range(first_id, first_id + count)}

    def start(self) -> list[Step]:
        return [Step(FIRST, 0, m, batch=self.batch) for m in self.microbatches]

    @property
    def complete(self) -> bool:
        """Every micro-batch finished its backward: the round may open."""
        return all(mb.finished for mb in self.microbatches.values())

    @property
    def counted(self) -> bool:
        """Every stage's gradient of every micro-batch was delivered: the round may close."""
        return all(len(mb.delivered) == self.num_stages for mb in self.microbatches.values())

    @property
    def tasks_done(self) -> int:
        """Tasks of this batch whose accepted result still counts: a forward per stage but the
        last, a backward (or ``last``) per stage; a stage gradient sent to be recomputed is not
        done again until its redo's result is accepted."""
        return sum(len(mb.forward_workers) + len(mb.owners) for mb in self.microbatches.values())

    @property
    def loss_sum(self) -> float:
        return sum(mb.loss_sum or 0.0 for mb in self.microbatches.values())

    def accept(
        self, step: Step, worker: str, *, rows: int | None = None, loss_sum: float | None = None
    ) -> Step | None:
        """The result of ``step`` by ``worker`` was accepted; the step that follows, if any."""
        mb, k, last = self.microbatches[step.microbatch], step.stage, self.num_stages - 1
        if step.kind == FIRST:
            mb.rows = rows
        if step.kind in (FIRST, FORWARD):
            mb.forward_workers[k] = worker
            return Step(LAST if k + 1 == last else FORWARD, k + 1, mb.index, batch=self.batch)
        mb.owners[k] = worker
        if step.kind == LAST and not step.redo:
            mb.loss_sum = loss_sum
        if step.redo:
            return None
        if k == 0:
            mb.finished = True
            return None
        return Step(BACKWARD, k - 1, mb.index, prefer=mb.forward_workers.get(k - 1), batch=self.batch)

    def replace(self, microbatch: int, fresh: int) -> None:
        """Drop ``microbatch`` (nothing of it was accepted past the forward pass) for a new one."""
        mb = self.microbatches.pop(microbatch)
        assert not mb.owners, "a micro-batch holding accepted stage gradients cannot be replaced"
        self.microbatches[fresh] = MicroBatch(fresh)

    def owned(self, worker: str) -> dict[int, list[int]]:
        """stage -> the micro-batches whose gradient ``worker`` holds and has not delivered."""
        out: dict[int, list[int]] = {}
        for mb in self.microbatches.values():
            for k, owner in mb.owners.items():
                if owner == worker and k not in mb.delivered:
                    out.setdefault(k, []).append(mb.index)
        return out

    def deliver(self, stage: int, microbatches: list[int], worker: str) -> None:
        """``worker``'s upload of ``stage``'s gradient of ``microbatches`` committed: each counts,
        if ``worker`` still holds it (one sent to be recomputed is its redo's to deliver)."""
        for m in microbatches:
            mb = self.microbatches[m]
            if mb.owners.get(stage) == worker:
                mb.delivered.add(stage)

    def orphan(
        self, worker: str, keep: AbstractSet[tuple[int, int]] = frozenset(), only: tuple[int, set[int]] | None = None
    ) -> list[Step]:
        """``worker`` left (or its upload failed: ``only`` those micro-batches of that stage):
        redo steps for each stage gradient it held and had not delivered, except ``keep``:
        (stage, micro-batch) pairs whose upload is still in flight."""
        redo = []
        for k, ms in self.owned(worker).items():
            for m in ms:
                if (k, m) in keep or only is not None and (k != only[0] or m not in only[1]):
                    continue
                del self.microbatches[m].owners[k]
                redo.append(Step(LAST if k == self.num_stages - 1 else BACKWARD, k, m, redo=True, batch=self.batch))
        return redo
