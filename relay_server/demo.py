"""``relay-server demo`` and ``trial``: a whole collaboration on this machine, to see it work.

A relay (in this process, on 127.0.0.1, state in a temporary directory) and N peer processes
(``python -m toolkit.peer``, one CPU thread each) train on the text the toolkit ships. Recipes:
``byte-lm`` (default: the byte-level transformer of ``defaults/demo.toml``), ``albert-tiny``
(``defaults/albert-tiny.toml``: the sahajBERT recipe in miniature; its WordPiece tokenizer is
trained on the shipped text first, as ``relay-server tokenizer train`` would), ``pipeline-tiny``
(``defaults/pipeline-tiny.toml``: the byte-level transformer cut into 2 stages, each peer running
one; the staged pipeline of ``relay_server.pipeline``) and ``dmoe-lm-tiny``
(``defaults/dmoe-lm-tiny.toml``: Learning@home's language model in miniature, a decoder whose
feed-forward blocks are mixtures of experts; a BPE tokenizer is trained first, and two expert
host processes, ``python -m toolkit.moe.host``, hold the experts before the peers start). One line per
optimizer step; the last line is a JSON summary. Both print the loss references the relay
computes (chance level; the demo text's unigram entropy), so a newcomer can tell learning from noise.

``relay-server trial --config run.toml`` (:mod:`relay_server.trial`) is the same machinery
(:class:`LocalRun`) on an organizer's own run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from relay_server.core.config import ConfigError, RelayConfig, load_config
from relay_server.harness.thread import RelayThread
from toolkit.errors import CollabError
from toolkit.runtime.parent import child_env
from toolkit.wire.protocol import ROUTES, StatusReport

if TYPE_CHECKING:
    from relay_server.moe.moe_config import MoeSection

RECIPES = ("byte-lm", "albert-tiny", "pipeline-tiny", "dmoe-lm-tiny")
TOKENIZED = {"albert-tiny": "wordpiece", "dmoe-lm-tiny": "bpe"}
"""Recipes whose tokenizer the demo trains on the shipped text first, and its model."""
EXPERT_HOSTS = 2
"""Expert host processes a demo of a run with [moe] starts, together holding every expert."""
OVERSHOOT_POLICY = {
    "reported": (
        "a round opens when the peers' reported samples reach {target}; each peer (reporting after "
        "every micro-batch) then adds at most the micro-batch it was computing, so a step applies "
        "{target} to {most} samples (each line says how many; --open-round projected or a smaller "
        "--batch-size keeps it closer to the target)"
    ),
    "projected": (
        "a round opens when the reported samples plus the micro-batch each other peer is computing "
        "reach {target}: steps land closer to {target}, so a step applies {least} to {most} samples "
        "(below {target} when a peer's micro-batch misses the round; each line says how many)"
    ),
}
"""What the header says of a step's samples. The bounds hold because the demo's peers report after
every micro-batch (``python -m toolkit.peer --report-interval 0``): a peer that reports at most every
0.5 s, with micro-batches faster than that, adds what it computed meanwhile, however many."""

CLOSED_DASHBOARD = (
    "dashboard: closed with the demo ({url}/ no longer answers); run the demo with --keep to keep "
    "the relay and its dashboard up after the last step, until Ctrl-C"
)
"""The line just before the JSON summary of a demo without ``--keep`` (the summary stays the last line)."""
ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
"""Besides Ctrl-C (SIGINT): what ends a demo or a trial as an interruption, its cleanup included."""


@contextlib.contextmanager
def ending_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end the demo as Ctrl-C does (KeyboardInterrupt in the main thread): its
    peers, expert hosts and relay are stopped and its temporary directory removed, instead of the
    process vanishing with them left behind. Only the first signal interrupts: the cleanup it
    starts is not cut short by another. Outside the main thread (an embedding app) nothing changes."""

    def interrupt(signum: int, frame: object) -> None:
        for number in (signal.SIGINT, *ENDING_SIGNALS):
            signal.signal(number, signal.SIG_IGN)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, interrupt) for number in (signal.SIGINT, *ENDING_SIGNALS)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def applied_range(target: int, peers: int, batch_size: int) -> dict[str, int]:
    """The samples a demo step may apply (:data:`OVERSHOOT_POLICY`): at most the target plus one
    micro-batch per peer; at least the target, or with ``projected`` rounds the target less the
    other peers' micro-batches that may miss the round."""
    return {"target": target, "most": target + peers * batch_size, "least": max(1, target - (peers - 1) * batch_size)}


def recipe_config(recipe: str, directory: Path, overrides: dict[str, Any]) -> RelayConfig:
    """The demo run's configuration (training the recipe's tokenizer into ``directory`` first)."""
    if recipe == "byte-lm":
        return load_config(None, overrides=overrides)
    if recipe == "pipeline-tiny":  # its batch is its micro-batches': --target-batch does not apply
        run = {k: v for k, v in overrides.get("run", {}).items() if k != "target_batch"}
        with resources.as_file(resources.files("relay_server").joinpath("defaults/pipeline-tiny.toml")) as toml:
            return load_config(toml, overrides={**overrides, "run": run})
    if recipe not in TOKENIZED:
        raise ConfigError(f"--recipe must be one of {RECIPES}, got {recipe!r}")
    # albert-tiny's model is transformers'; dmoe-lm-tiny's is the toolkit's own, which needs only the tokenizer
    needed = ("tokenizers", "transformers") if recipe == "albert-tiny" else ("tokenizers",)
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"--recipe {recipe} needs {' and '.join(missing)}: "
            "pip install -e '.[hf]' (or pip install 'collabtrain[hf]')"
        )
    from relay_server.data.tokenizer_train import train_for_run

    path = resources.files("relay_server").joinpath(f"defaults/{recipe}.toml")
    with resources.as_file(path) as toml:
        config = load_config(toml, overrides=overrides, run_data=False)
        tokenizer = directory / "tokenizer.json"
        vocab = (
            config.model.config["vocab_size"]
            if config.model.kind == "transformers"
            else config.model.kwargs["vocab_size"]
        )
        train_for_run(config, str(tokenizer), vocab_size=int(vocab), model=TOKENIZED[recipe])
        return load_config(toml, overrides={**overrides, "tokenizer": {"file": str(tokenizer)}})


def run_demo(
    *,
    peers: int = 3,
    steps: int = 30,
    target_batch: int = 32,
    batch_size: int = 8,
    data_dir: str | None = None,
    port: int = 0,
    compression: str = "none",
    recipe: str = "byte-lm",
    keep: bool = False,
    open_round: str = "reported",
) -> int:
    """Run the demo; with ``keep`` the relay and its dashboard stay up after the last step until
    Ctrl-C, so the finished run can be looked at."""
    with ending_signals():
        tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="collab-demo-")
        try:
            return _demo(
                Path(data_dir or tmp.name),  # type: ignore[union-attr]  # tmp is set when data_dir is not
                peers=peers,
                steps=steps,
                target_batch=target_batch,
                batch_size=batch_size,
                port=port,
                compression=compression,
                recipe=recipe,
                keep=keep,
                open_round=open_round,
                temporary=tmp is not None,
            )
        finally:
            if tmp is not None:
                tmp.cleanup()


def _demo(
    directory: Path,
    *,
    peers: int,
    steps: int,
    target_batch: int,
    batch_size: int,
    port: int,
    compression: str,
    recipe: str,
    keep: bool,
    open_round: str,
    temporary: bool,
) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    config = recipe_config(
        recipe,
        directory,
        {
            "server": {"host": "127.0.0.1", "port": port, "data_dir": str(directory / "relay")},
            "run": {"total_steps": steps, "target_batch": target_batch, "compression": compression},
            "rounds": {"open_round": open_round},
        },
    )
    if config.pipeline.enabled:
        batch_size, target_batch = config.pipeline.microbatch_size, config.run.target_batch
    header = [
        f"model:     {config.model.label()} ({recipe}), optimizer {config.optimizer.name}",
        *([f"pipeline:  {config.pipeline.stages} stages; each peer runs one"] if config.pipeline.enabled else []),
        f"peers:     {peers} CPU processes, micro-batch {batch_size}, target batch {target_batch}, "
        f"{steps} steps, compression {compression}",
        f"rounds:    {OVERSHOOT_POLICY[open_round].format(**applied_range(target_batch, peers, batch_size))}"
        if not config.pipeline.enabled
        else f"rounds:    a step applies exactly {target_batch} samples: every stage steps once all "
        f"{config.pipeline.microbatches_per_batch} micro-batches of the batch ran forward and backward",
        f"state:     {directory} ("
        + (
            "temporary: removed when the demo ends, whatever ends it; --data-dir DIR keeps it)"
            if temporary
            else "kept after the demo)"
        ),
    ]
    return LocalRun("demo", config, directory, peers=peers, batch_size=batch_size, threads=1).run(
        header, keep=keep, closing=None if keep else CLOSED_DASHBOARD
    )


class LocalRun:
    """A relay in this process and peer processes (``python -m toolkit.peer``) on this machine,
    followed through ``/api/status``: one line per optimizer step, a JSON summary last. The demo
    and the trial differ only in their configuration and their header."""

    def __init__(
        self,
        name: str,
        config: RelayConfig,
        directory: Path,
        *,
        peers: int,
        batch_size: int,
        threads: int,
        stop_after: int | None = None,
    ) -> None:
        self.name, self.config, self.directory, self.peers = name, config, directory, peers
        self.batch_size, self.threads, self.stop_after = batch_size, threads, stop_after
        self.losses: dict[int, float] = {}
        self.samples: dict[int, int] = {}
        self.times: dict[int, float] = {}
        self.references: dict[str, float] = {}
        self.hosts: list[subprocess.Popen[bytes]] = []

    def run(self, header: list[str], *, keep: bool, interrupt_ends: bool = False, closing: str | None = None) -> int:
        """Start, follow until the run finishes (or ``stop_after`` steps, or Ctrl-C when
        ``interrupt_ends``: then it is the normal end), stop; with ``keep`` the relay stays up
        after the last step until Ctrl-C. ``closing`` (with ``{url}``): printed once the relay
        stopped, just before the JSON summary. Returns the exit code."""
        relay = RelayThread(self.config)
        try:
            url = relay.start().url
        except RuntimeError as exc:  # the relay's own error, in one line: the run's config, not this tool
            print(f"{self.name} stopped: {exc}", file=sys.stderr)
            return 1
        print(f"relay:     {url}   (dashboard: {url}/ , status JSON: {url}/api/status)", flush=True)
        for line in header:
            print(line, flush=True)
        client = requests.Session()  # the demo follows /api/status as any observer does, not as a peer
        procs: list[subprocess.Popen[bytes]] = []
        code, kept = 0, False
        try:
            references = _status(client, url).loss_references
            self.references = {r.name: round(r.value, 4) for r in references}
            if references:
                print("losses:    " + "; ".join(f"{r.label} = {r.value:.4f}" for r in references), flush=True)
            if self.config.moe.enabled:  # the experts live on hosts: they hold them all before anyone trains
                self.hosts = start_expert_hosts(url, self.config.moe, self.directory)
            extra = ["--max-steps", str(self.stop_after)] if self.stop_after else []
            if self.config.model.kind == "module":  # the organizer's own package, on the organizer's machine
                extra += ["--trusted-model", self.config.model.factory.split(":")[0].split(".")[0]]
            if not self.config.pipeline.enabled:  # a trainer's options: a stage worker takes the run's micro-batch
                extra += ["--batch-size", str(self.batch_size), "--report-interval", "0"]
            procs += [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "toolkit.peer",
                        "--relay",
                        url,
                        "--name",
                        f"peer-{i}",
                        "--seed",
                        str(1000 + i),
                        "--threads",
                        str(self.threads),
                        *extra,
                    ],
                    env=child_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=open(self.directory / f"peer-{i}.log", "w"),
                )
                for i in range(self.peers)
            ]
            code = self._follow(client, url, procs)
            _stop_peers(procs)
            if keep and code == 0:
                kept = True
                print(f"--keep: the relay and its dashboard stay up at {url}/ ; press Ctrl-C to stop them", flush=True)
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            if not kept and not interrupt_ends:
                print(f"{self.name} stopped: interrupted", file=sys.stderr)
                code = 1
        except (CollabError, requests.RequestException) as exc:
            print(f"{self.name} stopped: {exc}", file=sys.stderr)
            code = 1
        finally:
            _stop_peers(procs, grace_s=0 if code or interrupt_ends else 20)
            _stop_peers(self.hosts, grace_s=0)
            client.close()
            relay.stop()
        if closing:
            print(closing.format(url=url), flush=True)
        ordered = [self.losses[s] for s in sorted(self.losses)]
        print(
            json.dumps(
                {
                    "steps": max(self.losses, default=0),
                    "peers": self.peers,
                    "first_loss": round(ordered[0], 4) if ordered else None,
                    "last_loss": round(ordered[-1], 4) if ordered else None,
                    "samples_per_s": round(_rate(self.samples, self.times), 2),
                    "loss_references": self.references,
                }
            ),
            flush=True,
        )
        return code

    def _follow(self, client: requests.Session, url: str, procs: list[subprocess.Popen[bytes]]) -> int:
        """Print each new step until the run finishes or ``stop_after``; 1 if every peer died first."""
        total = self.config.run.total_steps
        target = self.config.run.target_batch
        while True:
            status = _status(client, url)
            for r in status.recent_rounds:
                if r.step not in self.losses:
                    self.losses[r.step], self.samples[r.step] = r.loss or float("nan"), r.samples
                    self.times[r.step] = time.monotonic()
                    rate = _rate(self.samples, self.times)
                    of = f"/{total}" if total else ""
                    print(
                        f"step {r.step:4d}{of}  loss {self.losses[r.step]:.4f}  samples/s {rate:7.1f}  "
                        f"peers {status.num_peers}  (applied {r.samples} of target {target} samples "
                        f"from {r.contributors} peers in {r.duration_s:.2f}s)",
                        flush=True,
                    )
            if status.finished or (self.stop_after and max(self.losses, default=0) >= self.stop_after):
                return 0
            if all(p.poll() is not None for p in procs):
                tail = (self.directory / "peer-0.log").read_text(errors="replace").strip().splitlines()[-15:]
                print("all peers exited early; the end of peer-0's log:", *tail, sep="\n  ", file=sys.stderr)
                return 1
            time.sleep(0.25)


def _status(session: requests.Session, url: str) -> StatusReport:
    """The run's ``/api/status``, what the dashboard reads: the demo watches its relay from outside,
    so it needs no peer's client (the relay imports only the toolkit's shared layer)."""
    response = session.get(url + ROUTES["status"], timeout=30)
    response.raise_for_status()
    return StatusReport.loads(response.content)


def start_expert_hosts(
    url: str, moe: MoeSection, directory: Path, timeout_s: float = 120
) -> list[subprocess.Popen[bytes]]:
    """:data:`EXPERT_HOSTS` expert host processes that together lease every expert of ``moe``
    (the run's [moe] section), started and waited for until the relay's directory lists them all."""
    experts = len(moe.uids())
    capacity = -(-experts // EXPERT_HOSTS)
    hosts = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "toolkit.moe.host",
                "--relay",
                url,
                "--capacity",
                str(capacity),
                "--name",
                f"host-{i}",
            ],
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=open(directory / f"host-{i}.log", "w"),
        )
        for i in range(EXPERT_HOSTS)
    ]
    print(
        f"experts:   {experts} ({moe.layers} layers of {'x'.join(map(str, moe.grid))}, top {moe.k}) on "
        f"{EXPERT_HOSTS} expert hosts (python -m toolkit.moe.host --capacity {capacity})",
        flush=True,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while len(requests.get(url + ROUTES["moe_directory"], timeout=10).json()["live"]) < experts:
            if time.monotonic() > deadline or any(h.poll() is not None for h in hosts):
                raise CollabError(
                    "experts_not_hosted",
                    f"the expert hosts did not lease all {experts} experts",
                    f"Read {directory}/host-0.log.",
                )
            time.sleep(0.25)
    except BaseException:
        _stop_peers(hosts, grace_s=0)
        raise
    return hosts


def _rate(samples: dict[int, int], times: dict[int, float]) -> float:
    """Collaboration throughput over the steps seen so far (the first step's samples started
    the clock, so they are not counted)."""
    steps = sorted(times)
    if len(steps) < 2 or times[steps[-1]] <= times[steps[0]]:
        return 0.0
    return sum(samples[s] for s in steps[1:]) / (times[steps[-1]] - times[steps[0]])


def _stop_peers(procs: list[subprocess.Popen[bytes]], grace_s: float = 20) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
