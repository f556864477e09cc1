"""The relay's copy of the slices aggregators own, to recover any of them when its owner dies.

Whole-vector arrays in the layout-free state format (``params``, lossy ``public``, ``opt.*``,
``opt_scalar.*``; :meth:`relay_server.rounds.master.MasterState.export_state`), plus, per slice range,
the step its parameters and its optimizer state are from. Filled completely at every plan
change (the relay has just assembled the whole state), then kept up to date in the background:
every remote slice's published parameters every ``aggregators.params_copy_every`` steps (by
default after each step: P x 4 bytes into the relay per step), its whole state every
``aggregators.state_copy_every`` steps. Saved to ``state/recovery-copy.safetensors``
with each state pull, so a relay restart that finds an aggregator gone can still resume.

So a recovered slice has parameters at most ``params_copy_every`` steps old (by default one: the
step before the round in which its owner died, unless that step's pull had not finished) and
optimizer state at most ``state_copy_every`` steps old. For a lossy codec the copy's parameters
are the public ones (what peers hold); the lost master is replaced by them (within one
quantization step).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from relay_server.backbone.state_transfer import CallFailed, InternalClient
from relay_server.rounds.publisher import sha256_of
from toolkit.wire.protocol import ROUTES, ParamsManifest
from toolkit.wire.tensor_container import read_file_header, write_file

log = logging.getLogger(__name__)

Range = tuple[int, int]


@dataclass
class RecoveryCopy:
    state: dict[str, np.ndarray]
    params_step: dict[Range, tuple[int, str]] = field(default_factory=dict)  # -> (step, sha256 of its params)
    opt_step: dict[Range, int] = field(default_factory=dict)

    @classmethod
    def of(cls, state: dict[str, np.ndarray], step: int, shas: dict[Range, str]) -> "RecoveryCopy":
        """The whole ``state`` of ``step``, whose slices published ``shas``."""
        copy = cls(state=dict(state))
        for rng, sha in shas.items():
            copy.params_step[rng], copy.opt_step[rng] = (step, sha), step
        return copy

    def holds(self, rng: Range, step: int, sha256: str | None) -> bool:
        """Whether the copy has exactly the published parameters of ``rng`` at ``step``."""
        return self.params_step.get(rng) == (step, sha256)

    def fill(self, state: dict[str, np.ndarray], rng: Range) -> tuple[int, int]:
        """Write the copy of ``rng`` into a whole-vector ``state`` (in place); returns the steps its
        parameters and optimizer state are from. Raises KeyError when the copy never had it."""
        params_step, _ = self.params_step[rng]
        a, b = rng
        for name, array in self.state.items():
            if name.startswith("opt_scalar."):
                state.setdefault(name, array)
            elif name in state:
                state[name][a:b] = array[a:b]
        if "public" in self.state:  # the lost master of a lossy slice: its public copy stands in
            state["params"][a:b] = self.state["public"][a:b]
        return params_step, self.opt_step.get(rng, -1)

    async def pull(
        self, client: InternalClient, manifest: ParamsManifest, urls: dict[str, str], with_state: bool
    ) -> None:
        """Bring the slices of ``manifest`` owned at ``urls`` (aggregator id -> URL) into the copy:
        their parameters, or their whole state with ``with_state``. Slices that fail stay older."""
        params = self.state.get("public", self.state["params"])
        for s in manifest.slices:
            url = urls.get(s.aggregator_id)
            if url is None:
                continue
            rng = (s.start, s.end)
            try:
                if with_state:
                    meta, tensors, _ = await client.fetch_tensors(
                        url + ROUTES["slice_state"], {"step": str(manifest.step)}
                    )
                    if (
                        int(meta.get("step", -1)) != manifest.step
                        or sha256_of(tensors.get("public", tensors["params"])) != s.sha256
                    ):
                        continue
                    for name, array in tensors.items():
                        if name.startswith("opt_scalar."):
                            self.state[name] = array
                        elif name in self.state:
                            self.state[name][s.start : s.end] = array
                    self.opt_step[rng] = manifest.step
                else:
                    meta, _, _ = await client.fetch_tensors(
                        url + ROUTES["params"],
                        {"start": s.start, "end": s.end, "min_step": manifest.step},
                        out={"params": params[s.start : s.end]},
                    )
                    if (
                        meta.get("kind") != "full"
                        or int(meta.get("step", -1)) != manifest.step
                        or sha256_of(params[s.start : s.end]) != s.sha256
                    ):
                        continue
                self.params_step[rng] = (manifest.step, s.sha256)
            except CallFailed as exc:
                log.info("copy of [%d, %d) at step %d not pulled: %s", s.start, s.end, manifest.step, exc)

    async def save(self, path: Path, *, fsync: bool = False) -> None:
        ranges = [
            [a, b, *self.params_step.get((a, b), (-1, "")), self.opt_step.get((a, b), -1)]
            for a, b in sorted(set(self.params_step) | set(self.opt_step))
        ]
        tensors = [(name, np.ascontiguousarray(array)) for name, array in sorted(self.state.items())]
        await asyncio.to_thread(write_file, path, tensors, {"ranges": json.dumps(ranges)}, fsync=fsync)

    @classmethod
    def load(cls, path: Path) -> "RecoveryCopy | None":
        if not path.exists():
            return None
        copy = cls(state={name: np.array(array) for name, array in load_file(str(path)).items()})
        for a, b, params_step, sha, opt_step in json.loads(read_file_header(path).metadata.get("ranges", "[]")):
            copy.params_step[(a, b)] = (params_step, sha)
            copy.opt_step[(a, b)] = opt_step
        return copy
