"""Reading what W&B wrote offline: the records of a ``.wandb`` transaction log (checksums verified),
those of a finished run once they are all on disk, the history rows and the run config in them."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024  # a .wandb log's block size
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4  # record kinds


def read_wandb_records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` transaction log, in order, checksums verified."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a wandb transaction log"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (crc, length, kind) == (0, 0, 0):
            pos += _BLOCK - pos % _BLOCK
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"corrupt record at byte {pos}"
        pos += 7 + length
        if kind in (_FULL, _FIRST):
            pending = chunk
        elif kind in (_MIDDLE, _LAST):
            pending += chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def finished_run_records(path: Path, timeout_s: float = 60) -> list[Any]:
    """The records of a finished run's log, once its ``exit`` record is in. wandb-core writes the
    log from its own process and can still be flushing it when ``finish()`` (or the process that
    called it) has returned: seen once in a CI run with two test workers, where the log read right
    after ``close()`` held no ``run`` record yet. ``TimeoutError`` if the run never ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_wandb_records(path) if path.exists() else []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            kinds = [r.WhichOneof("record_type") for r in records]
            raise TimeoutError(f"{path} has no exit record after {timeout_s:.0f} s; its records: {kinds}")
        time.sleep(0.1)


def history_rows(records: list[Any]) -> list[dict[str, Any]]:
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def run_config(records: list[Any]) -> dict[str, Any]:
    """The run's config: its initial value, then every update, as W&B would show it."""
    config: dict[str, Any] = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        for item in updates:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config
