"""Where a round's time goes on the relay: ``python benchmarks/round_trace.py serve ...`` is
``relay-server serve ...`` with the round's phases timed, one line per call to ``$ROUND_TRACE``.

It wraps the relay's own functions (nothing else changes): each upload's whole receive
(``upload``: reading, validating and staging every chunk, then the commit), the reducer thread's
staging of one chunk (``stage``) and adding one committed upload (``commit``), the mean
(``mean``), the optimizer step (``step``), writing the version (``write``, hashing on a second
thread inside it: ``hash``) and each download served (``send``). ``benchmarks/allreduce.py
--breakdown`` starts the relay through this and prints the phases per round next to what the
peers measured (uploading, downloading and verifying).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_OUT = open(os.environ["ROUND_TRACE"], "a", buffering=1)
_LOCK = threading.Lock()


def _note(what: str, started: float, ended: float) -> None:
    with _LOCK:
        _OUT.write(f"{what} {started:.6f} {ended:.6f}\n")


def _timed(owner: type, name: str, label: str) -> None:
    original = getattr(owner, name)
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def traced(*args, **kwargs):
            started = time.time()
            try:
                return await original(*args, **kwargs)
            finally:
                _note(label, started, time.time())
    else:

        @functools.wraps(original)
        def traced(*args, **kwargs):
            started = time.time()
            try:
                return original(*args, **kwargs)
            finally:
                _note(label, started, time.time())

    setattr(owner, name, traced)


def main() -> None:
    from relay_server import cli
    from relay_server.rounds import master, publisher, reducer

    for owner, name, label in [
        (reducer.Reducer, "reduce", "upload"),
        (reducer.Reducer, "_stage", "stage"),
        (reducer.Reducer, "_commit", "commit"),
        (reducer.Reducer, "finish_mean", "mean"),
        (master.MasterState, "apply_gradient", "step"),
        (publisher.Publisher, "write", "write"),
        (publisher.Publisher, "send", "send"),
    ]:
        _timed(owner, name, label)
    hash_of = publisher.sha256_of

    def traced_hash(array):
        started = time.time()
        try:
            return hash_of(array)
        finally:
            _note("hash", started, time.time())

    publisher.sha256_of = traced_hash
    sys.exit(cli.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
