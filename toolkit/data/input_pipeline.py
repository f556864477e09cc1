"""A peer's batches for the run it joined: the run's tokenizer and objective, or the byte stream.

:func:`peer_batches` is what :func:`toolkit.join` trains on when the volunteer passes no
``data=``. A run with an ``[objective]`` downloads the run's ``tokenizer.json`` from the relay
(refused unless its sha256 is the one ``RunInfo`` publishes), and the whole input pipeline --
reading shards, tokenizing, packing, masking -- runs on the :class:`~toolkit.data.background.Background`
worker with a relay client of its own (a ``requests`` session is not shared between threads).
A transformers run without an objective is refused: bytes are not what its embeddings expect.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

from toolkit.client import RelayClient
from toolkit.data.background import Background
from toolkit.data.objectives import ObjectiveConfig, load_tokenizer
from toolkit.data.shards import shard_sources_for_run
from toolkit.data.stream import batches_for_run
from toolkit.errors import DataConfigError
from toolkit.wire.protocol import RunInfo


def check_run_data(run: RunInfo) -> ObjectiveConfig | None:
    """The run's objective (None: byte-level batches), or a refusal saying what to do."""
    if run.objective:
        objective = ObjectiveConfig.from_dict(run.objective)
        if not run.tokenizer_sha256:
            raise DataConfigError(
                "no_tokenizer",
                f"run {run.run_name!r} has an objective but no tokenizer",
                'The organizer adds [tokenizer] file = "tokenizer.json" to the run\'s config '
                "(relay-server tokenizer train --config run.toml writes one).",
            )
        return objective
    if run.model.kind == "transformers":
        raise DataConfigError(
            "no_objective",
            f"run {run.run_name!r} trains a transformers model but names no "
            "tokenizer and objective, so there is nothing to turn its text into tokens",
            "Pass your own dict batches (join(..., data=...)), or ask the organizer to add "
            '[tokenizer] file = ... and [objective] name = "masked-lm" (or "causal-lm") '
            "to the run's config.",
        )
    return None


def peer_batches(
    run: RunInfo, client: RelayClient, peer_id: str, *, batch_size: int, seed: int | str, depth: int = 4
) -> Iterator[Any]:
    """The batches this peer trains on (close them to release leased shards)."""
    objective = check_run_data(run)
    if objective is None:
        return batches_for_run(
            run.dataset,
            batch_size=batch_size,
            seq_len=int(run.model.kwargs.get("seq_len", 64)),
            seed=seed,
            shard_source=shard_sources_for_run(run.dataset, client, peer_id),
        )
    tokenizer = load_tokenizer(client.get_tokenizer(run.tokenizer_sha256))
    data_client = RelayClient(client.url, auth=client.session.auth)
    try:
        stream = batches_for_run(
            run.dataset,
            batch_size=batch_size,
            seq_len=objective.seq_len,
            seed=seed,
            objective=objective,
            tokenizer=tokenizer,
            shard_source=shard_sources_for_run(run.dataset, data_client, peer_id),
        )
    except BaseException:
        data_client.close()
        raise
    return Background(_owning(stream, data_client), depth=depth)


def _owning(stream: Generator[Any, None, None], client: RelayClient) -> Generator[Any, None, None]:
    try:
        yield from stream
    finally:
        stream.close()
        client.close()
