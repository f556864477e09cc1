"""Uploads waiting for their last chunk: in memory within the process's budget, on disk past it,
and either way added whole or not at all, exactly.

The reducer is driven through its real container reader, from a stream that hands the body out
in uneven pieces as a socket does (a chunk arrives split across several reads)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from relay_server.core.errors import ApiError
from relay_server.rounds.reducer import CHUNK_ELEMS, MemoryBudget, Reducer, UploadProgress, _Spool
from toolkit.wire.compression import get_codec
from toolkit.wire.tensor_container import AsyncContainerReader, iter_encoded

NUMEL = 2 * CHUNK_ELEMS + 12_345  # three chunks, the last one short


class PiecewiseStream:
    """A request body read the way aiohttp hands it out: ``readany`` gives what one socket read
    got (uneven sizes), ``readexactly`` joins them."""

    def __init__(self, body: bytes, seed: int) -> None:
        self.body, self.pos = body, 0
        self.rng = np.random.default_rng(seed)

    async def readany(self) -> bytes:
        n = int(self.rng.integers(1, 300_000))
        piece = self.body[self.pos : self.pos + n]
        self.pos += len(piece)
        return piece

    async def readexactly(self, n: int) -> bytes:
        out = self.body[self.pos : self.pos + n]
        self.pos += len(out)
        if len(out) < n:
            raise asyncio.IncompleteReadError(out, n)
        return out


def upload(reducer: Reducer, grad: np.ndarray, seed: int) -> UploadProgress:
    body = b"".join(iter_encoded([("payload", grad)], {"codec": "none"}))
    reader = AsyncContainerReader(PiecewiseStream(body, seed), grad.nbytes, total_bytes=len(body))
    progress = UploadProgress()

    async def run() -> None:
        header = await reader.read_header()
        reducer.check(header)
        await reducer.reduce(reader, header, samples=1, still_open=lambda: True, progress=progress)

    asyncio.run(run())
    return progress


@pytest.mark.parametrize("limit_chunks", [100, 4, 1, 0])
def test_uploads_add_exactly_whatever_the_memory_budget(limit_chunks: int, monkeypatch, tmp_path) -> None:
    """100 chunks: every upload waits in memory; 4: the second upload spills to disk mid-way;
    1 and 0: (almost) everything waits on disk. The sums are identical, and every byte the
    budget lent is given back."""
    budget = MemoryBudget(limit_chunks * CHUNK_ELEMS * 4)
    monkeypatch.setattr("relay_server.rounds.reducer.UPLOAD_MEMORY", budget)
    reducer = Reducer(np.zeros(NUMEL, dtype=np.float32), get_codec("none"), spool_dir=str(tmp_path))
    grads = [np.random.default_rng(i).standard_normal(NUMEL, dtype=np.float32) for i in range(3)]
    try:
        for i, grad in enumerate(grads):
            assert upload(reducer, grad, seed=i).committed
        expected = np.zeros(NUMEL, dtype=np.float32)
        for grad in grads:
            expected += grad
        np.testing.assert_array_equal(reducer.sum, expected)
        assert budget.used == 0
    finally:
        reducer.close()


def test_a_refused_upload_gives_its_memory_back_and_adds_nothing(monkeypatch, tmp_path) -> None:
    budget = MemoryBudget(100 * CHUNK_ELEMS * 4)
    monkeypatch.setattr("relay_server.rounds.reducer.UPLOAD_MEMORY", budget)
    reducer = Reducer(np.zeros(NUMEL, dtype=np.float32), get_codec("none"), spool_dir=str(tmp_path))
    bad = np.ones(NUMEL, dtype=np.float32)
    bad[-1] = np.nan  # in the last chunk: the first two were already waiting in memory
    try:
        with pytest.raises(ApiError) as refused:
            upload(reducer, bad, seed=0)
        assert refused.value.code == "non_finite"
        assert not reducer.sum.any() and budget.used == 0
    finally:
        reducer.close()


def test_a_spool_past_its_budget_moves_what_it_held_to_disk(tmp_path) -> None:
    from toolkit.wire.tensor_container import Pieces

    budget = MemoryBudget(8)
    spool = _Spool(str(tmp_path), budget)
    chunks = [np.arange(2, dtype=np.float32), np.arange(2, 5, dtype=np.float32)]
    for c in chunks:
        raw = c.view(np.uint8)
        spool.write(Pieces(np.dtype(np.float32), c.size, [memoryview(raw[:3]), memoryview(raw[3:])]), c)
    assert spool.file is not None and budget.used == 0  # the second chunk did not fit: both on disk
    spool.rewind()
    staging = np.empty(64, dtype=np.uint8)
    for c in chunks:
        np.testing.assert_array_equal(spool.read(staging, c.nbytes, np.dtype(np.float32)), c)
    spool.close()
