"""What an own training loop needs from the run besides the optimizer: the run's model and the
run's data, built exactly as :func:`toolkit.join` builds them.

    model = toolkit.run_model(URL)                    # the run's architecture, from its config
    opt = CollaborativeOptimizer(model, URL, batch_size_per_step=8)
    for batch in opt.batches():                       # this peer's share of the run's data
        ...                                           # ends by itself when the run finishes

:meth:`CollaborativeOptimizer.batches` is also the loop's end: it stops yielding once the run has
finished, whatever wraps the optimizer afterwards (Accelerate's ``AcceleratedOptimizer`` has no
``finished``; the iterator holds the optimizer itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from toolkit.client import RelayClient
from toolkit.models import build_model, check_trusted

if TYPE_CHECKING:
    from toolkit.optimizer.core import CollaborativeOptimizer


def run_model(
    relay_url: str | None = None, *, client: RelayClient | None = None, trusted_models: Sequence[str] = ()
) -> torch.nn.Module:
    """The run's model, freshly built from the configuration the relay publishes (no weights
    downloaded: the optimizer loads the relay's parameters when it joins). A run whose model is
    an organizer's own package needs that package installed and named in ``trusted_models``."""
    if client is None and relay_url is None:
        raise ValueError("pass the relay's URL (run_model(URL)) or a client")
    own = client is None
    client = client or RelayClient(relay_url)  # type: ignore[arg-type]
    try:
        spec = client.get_run().model
    finally:
        if own:
            client.close()
    check_trusted(spec, trusted_models)  # before anything is imported
    torch.manual_seed(0)  # the relay's parameters replace these at once; only the shapes matter
    return build_model(spec, trusted_models)


def until_finished(
    opt: CollaborativeOptimizer, data: Iterable[Any] | None, batch_size: int, seed: int | str
) -> Iterator[Any]:
    """The micro-batches of :meth:`CollaborativeOptimizer.batches` (see there)."""
    if data is None:
        from toolkit.data.input_pipeline import peer_batches  # the data stack only for a loop that asks for it

        source: Iterator[Any] = peer_batches(opt.run, opt.client, opt.peer_id, batch_size=batch_size, seed=seed)
    else:
        source = _epochs(data)
    try:
        while not opt.finished:
            try:
                batch = next(source)
            except StopIteration:
                return
            if opt.finished:  # the step of the previous batch ended the run
                return
            opt.hold()  # not a micro-batch that could only overshoot the round about to open
            if opt.finished:
                return
            yield batch
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()  # a streaming source reports and releases the shards it holds


def _epochs(data: Iterable[Any]) -> Iterator[Any]:
    """``data`` again and again (a DataLoader reshuffles each pass); stops if a pass is empty."""
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        if empty:
            return
