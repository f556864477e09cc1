"""The first-stage input of the batches a rollback can reach, so that it replays them.

A first-stage task reads a micro-batch of the worker's own data and sends it with its result
(the last stage's loss needs the labels; :mod:`.results` validates it: int64 ``[microbatch_size,
tokens]`` arrays named ``batch`` or ``batch.<key>``). The relay already holds it as the ``batch``
boundary until the batch's round closes; this keeps a copy of it past the round, per committed
batch, for the ``[pipeline] rollback_batches`` batches a late ban may undo (:mod:`.rollback`).

After a rollback to version ``b0`` the micro-batches of every undone batch -- the committed ones
``b0 ..`` and those of the batch in flight whose first-stage result was accepted -- are *replayed*:
the next batches take the same micro-batch ids again (:meth:`~.rollback.PipelineRollback`), and a
first-stage task of such an id carries its kept data (:meth:`carried`); the worker computes on it
instead of its own data, and the relay refuses a result whose data is not the data carried
(:func:`same_data`). So the run equals one process that trained on every batch once, each
micro-batch with the data first read for it, as if the liar's batches had been honest. A
micro-batch's data that came from the banned liar is replayed as well: its lies were in its
computation, and which data a micro-batch holds is every data-parallel peer's own choice.

Bounded: ``R`` committed batches of ``microbatches_per_batch`` micro-batches, each
``microbatch_size x tokens`` int64 values per data tensor (8 bytes each) plus a container header
of about 72 bytes -- 2 x 9 x 8 + 72 = 216 bytes per micro-batch, 864 bytes per kept batch of 4,
for the byte model of the rollback test; 8 x 1,024 x 8 x 2 (``input_ids`` and ``labels``) + 104 =
131,240 bytes per micro-batch of GPT-2 at 8 x 1,024 tokens. In memory (``trust.kept_input_bytes``
says how much): the batch in flight's boundaries, which the relay holds anyway, are ``width``
times larger per micro-batch and stage.

Owns its copies; the rollback and the coordinator reach them only through its methods.
"""

from __future__ import annotations

import numpy as np

from relay_server.core.errors import ApiError
from toolkit.wire import payloads


class KeptInputs:
    """Committed batch -> {micro-batch id: its data container}, within the window; and the
    micro-batch ids whose next first-stage task carries its data (the replay)."""

    def __init__(self, keep: int) -> None:
        """``keep``: ``[pipeline] rollback_batches`` (0: nothing is kept, nothing is replayed)."""
        self.keep = keep
        self.batches: dict[int, dict[int, bytes]] = {}
        """Committed batch -> the data its micro-batches computed on (the newest ``keep`` batches)."""
        self.replaying: dict[int, bytes] = {}
        """Micro-batch id -> the data its first-stage task carries, until its batch commits."""

    def committed(self, batch: int, data: dict[int, bytes]) -> None:
        """``batch`` was counted with these micro-batches' data: kept while a rollback can reach
        it (a rollback reaches ``b0 >= step - keep``, and the step after ``batch`` is ``batch + 1``);
        the replay of its ids is over."""
        for m in data:
            self.replaying.pop(m, None)
        if self.keep <= 0:
            return
        self.batches[batch] = dict(data)
        self.batches = {b: kept for b, kept in self.batches.items() if b > batch - self.keep}

    def replay(self, b0: int, in_flight: dict[int, bytes]) -> tuple[int, int]:
        """A rollback to ``b0``: the committed batches ``b0 ..`` and the accepted first-stage data
        of the batch in flight (``in_flight``, dropped by the rollback) are replayed, in addition
        to any replay not yet committed (an earlier rollback's). Their records go: the replayed
        batches commit again under new batch numbers. Returns (batches, micro-batches) replayed."""
        undone = sorted(b for b in self.batches if b >= b0)
        for b in undone:
            self.replaying.update(self.batches.pop(b))
        self.replaying.update(in_flight)
        return len(undone), len(self.replaying)

    def carried(self, microbatch: int) -> bytes | None:
        """The data a first-stage task of ``microbatch`` carries (None: the worker reads its own)."""
        return self.replaying.get(microbatch)

    @property
    def bytes(self) -> int:
        """What the copies take (the window's and the replay's)."""
        return sum(len(v) for kept in self.batches.values() for v in kept.values()) + sum(
            len(v) for v in self.replaying.values()
        )


def refuse_other_data(microbatch: int, sent: bytes, carried: bytes | None) -> None:
    """A first-stage result whose task carried data (a replay) must send that data back: the
    boundary it computed is the replayed micro-batch's only if so (422 otherwise, nothing used)."""
    if carried is not None and not same_data(sent, carried):
        raise ApiError(
            422,
            "replay_mismatch",
            f"first-stage result for micro-batch {microbatch} carries other data than its task did",
            "Compute a task that carries its data on that data, and send it back unchanged.",
        )


def same_data(a: bytes, b: bytes) -> bool:
    """Whether two data containers hold the same tensors (names, dtypes, shapes and values)."""
    _, x = payloads.decode(a, len(a))
    _, y = payloads.decode(b, len(b))
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and np.array_equal(x[k], y[k]) for k in x
    )
