"""Volunteers of a pipeline run live through relay restarts: 4 real ``python -m toolkit.peer``
processes on a 2-stage run, the relay SIGKILLed while a worker is in the middle of downloading its
stage's parameters and again in the middle of a batch, each time started again on its port and
data dir. Every volunteer finishes the run (exit code 0) and the parameters equal one process
training on the batches the relay counted (relative difference <= 1e-5).

And the piece that used to end them: a stage download cut off mid-body is the transport's
retryable error -- fetched again, whole -- never urllib3's ``ProtocolError``, against a real HTTP
server that closes the connection half-way through the body.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import islice
from typing import Any

import numpy as np
import pytest
import requests

from relay_server.harness import zygote
from relay_server.harness.process import wait_exit
from tests.support.pipeline import accepted_batches, pipeline_overrides, relative_difference, replay
from tests.support.pipeline_models import BYTE_SPEC
from tests.support.processes import REPO
from tests.support.slow_proxy import SlowProxy
from tests.support.training import relay_params
from toolkit.client import RelayClient
from toolkit.client.params import DOWNLOAD_ATTEMPTS
from toolkit.corpus import demo_batches
from toolkit.errors import RelayUnreachable
from toolkit.pipeline.worker import StageWorker
from toolkit.roles.stage_worker import batch_digest
from toolkit.run_membership import Membership
from toolkit.wire import payloads
from toolkit.wire.protocol import PROTOCOL_VERSION, CollabState, JoinRequest, ParamsManifest, SliceVersion

pytestmark = pytest.mark.integration

VOLUNTEERS = 4
MICROBATCHES = 4
TOTAL_STEPS = 6
FIRST = re.compile(r"^(\S+ \S+) \S+ INFO toolkit\.roles\.stage_worker: micro-batch (\d+) taken .*\(sha256 (\w+)\)")


class Volunteer:
    """One ``python -m toolkit.peer`` process and what its verbose log says it did."""

    def __init__(self, relay_url: str, name: str, seed: int, folder) -> None:
        self.name, self.seed = name, seed
        self.log_path, self.out_path = folder / f"{name}.log", folder / f"{name}.out"
        self.proc = zygote.Popen(
            [sys.executable, "-m", "toolkit.peer", "--relay", relay_url, "--name", name, "--seed", str(seed), "-v"],
            stdout=open(self.out_path, "w"),
            stderr=open(self.log_path, "w"),
            cwd=REPO,
        )

    def events(self) -> list[dict[str, Any]]:
        """The first-stage micro-batches the relay took from this volunteer, as
        :func:`tests.support.pipeline.accepted_batches` reads them: the data found again by its
        digest in this volunteer's data stream (the demo text, in its seed's order)."""
        found = []
        for line in self.log_path.read_text().splitlines():
            if match := FIRST.match(line):
                t = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.append({"event": "first", "microbatch": int(match[2]), "digest": match[3], "t": t})
        stream = {}
        for batch in islice(demo_batches(2, BYTE_SPEC.kwargs["seq_len"], self.seed), 10_000):
            stream.setdefault(batch_digest(batch), batch.tolist())
            if all(e["digest"] in stream for e in found):
                break
        return [{**e, "batch": stream[e["digest"]]} for e in found]

    def wait(self, timeout_s: float) -> int:
        return wait_exit(self.proc, timeout_s, self.name, self.log_path)


def poll(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except requests.RequestException:
            value = None
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def restart(relay, proxy: SlowProxy) -> None:
    """SIGKILL the relay (its address stops answering: the proxy cuts what was in flight) and
    start it again on its port and data dir."""
    relay.kill()
    proxy.drop()
    relay.start()
    proxy.restore()


def test_volunteers_finish_through_relay_restarts_mid_download_and_mid_batch(start_relay, tmp_path):
    overrides = pipeline_overrides(BYTE_SPEC, stages=2, microbatches=MICROBATCHES)
    overrides["run"] = {**overrides["run"], "total_steps": TOTAL_STEPS}
    relay = start_relay(overrides)
    _, initial = relay_params(relay.url)
    proxy = SlowProxy(relay.port)
    volunteers = [Volunteer(proxy.url, f"v{i}", i, tmp_path) for i in range(VOLUNTEERS)]
    try:
        assert proxy.mid_download.wait(120), "no stage download was ever in flight"
        restart(relay, proxy)  # mid-download: a worker's stage parameters cut off half-way
        proxy.slow = False

        def mid_batch() -> bool:
            status = requests.get(relay.url + "/api/pipeline", timeout=5).json()
            return relay.status()["step"] >= 2 and 0 < status["finished"] < status["microbatches"]

        poll(mid_batch, 120, "a batch half done after the first restart")
        restart(relay, proxy)  # mid-batch: some micro-batches done, none of it committed

        codes = {v.name: v.wait(timeout_s=180) for v in volunteers}
        logs = {v.name: v.log_path.read_text() for v in volunteers}
        assert codes == {v.name: 0 for v in volunteers}, "\n".join(f"{n}: {t[-2000:]}" for n, t in logs.items())
        for v in volunteers:
            assert json.loads(v.out_path.read_text())["finished"], logs[v.name][-2000:]
            assert "Traceback" not in logs[v.name], logs[v.name]  # no thread of it died either
        assert any("was cut off" in text for text in logs.values()), "no volunteer saw its download cut"
        assert "Traceback" not in relay.log_path.read_text(), relay.log_path.read_text()[-3000:]
        step, final = relay_params(relay.url, min_step=TOTAL_STEPS)
        assert step == TOTAL_STEPS
        batches = accepted_batches(volunteers, latest=True)  # a crashed batch's micro-batches were read again
        reference = replay(BYTE_SPEC, initial, batches, steps=step, microbatches=MICROBATCHES)
        assert relative_difference(final, reference) <= 1e-5
    finally:
        for v in volunteers:
            if v.proc.poll() is None:
                v.proc.kill()
                v.proc.wait(10)
        proxy.close()


def test_a_failing_progress_display_never_ends_a_worker(serve_relay):
    """The display is cosmetic: a callback that fails with the relay's error every time is logged
    and skipped, and the worker serves on until it is stopped."""
    relay = serve_relay(pipeline_overrides(BYTE_SPEC, stages=2, microbatches=MICROBATCHES))
    client = RelayClient(relay.url)
    membership = Membership(client, JoinRequest(peer_name="w", protocol=PROTOCOL_VERSION, device={}))
    membership.join()
    worker = StageWorker(membership, client.get_run(), demo_batches(2, BYTE_SPEC.kwargs["seq_len"], 0))
    shown = []

    def show(progress) -> None:
        shown.append(progress)
        if len(shown) == 3:
            worker.stop()
        raise RelayUnreachable("relay_unreachable", "the display's own call to the relay failed")

    try:
        worker.run(on_progress=show, wait_s=1)  # returns: stopped, not ended by the display
    finally:
        membership.leave()
        client.close()
    assert len(shown) == 3 and shown[-1].stage == 0


class CuttingServer(BaseHTTPRequestHandler):
    """Just enough of a relay: the parameter manifest names one stage at step 3, and the stage's
    body and ``/api/progress``'s answer are cut off half-way for the first ``cuts`` requests of
    each (Content-Length promised, half sent, connection closed), whole after."""

    stage = np.arange(1000, dtype=np.float32)
    cuts = 1
    served: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.startswith("/api/progress"):
            kind, content_type = "progress", "application/json"
            body = CollabState(
                step=3, target_batch=8, samples_accumulated=2, samples_per_s=1.0, eta_s=6.0, num_peers=4, round=None
            ).dumps()
        elif "start=" in self.path:
            kind, content_type = "stage", "application/octet-stream"
            body = payloads.encode({"params": self.stage}, {"step": "3"})
        else:
            kind, content_type = "manifest", "application/json"
            digest = hashlib.sha256(self.stage.tobytes()).hexdigest()
            whole = SliceVersion(aggregator_id="stage0", start=0, end=self.stage.size, sha256=digest)
            body = ParamsManifest(step=3, num_params=self.stage.size, plan_version="p", slices=[whole]).dumps()
        cut = kind != "manifest" and self.served.count(kind) < self.cuts
        self.served.append(kind)
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if cut else body)
        if cut:
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def cutting_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), CuttingServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    CuttingServer.served = []
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("cuts", [1, 100])
def test_a_stage_download_cut_mid_body_is_retried_then_a_transport_error(cutting_server, cuts):
    """One cut: the stage is fetched again and arrives whole. Every try cut: the caller gets the
    transport's ``RelayUnreachable`` (which every role's loop waits out), saying what was cut and
    what to do -- never urllib3's ``ProtocolError``."""
    CuttingServer.cuts = cuts
    client = RelayClient(f"http://127.0.0.1:{cutting_server.server_address[1]}", backoff_s=0.01)
    out = np.zeros(CuttingServer.stage.size, dtype=np.float32)
    try:
        if cuts == 1:
            assert client.pipeline.download_stage("p1", 0, out.size, out, min_step=3) == 3
            np.testing.assert_array_equal(out, CuttingServer.stage)
        else:
            with pytest.raises(RelayUnreachable) as raised:
                client.pipeline.download_stage("p1", 0, out.size, out, min_step=3)
            assert raised.value.code == "transfer_cut" and "cut off" in raised.value.message, raised.value
            assert "keeps retrying" in raised.value.hint
    finally:
        client.close()
    assert CuttingServer.served.count("stage") == (2 if cuts == 1 else DOWNLOAD_ATTEMPTS), CuttingServer.served


@pytest.mark.parametrize("cuts", [1, 100])
def test_an_answer_cut_mid_body_is_asked_again_then_a_transport_error(cutting_server, cuts):
    """The answers ``requests`` reads for the caller (progress, work, an expert's tasks): one cut
    off is asked again; cut every time, the transport's ``RelayUnreachable`` after its retries."""
    CuttingServer.cuts = cuts
    client = RelayClient(f"http://127.0.0.1:{cutting_server.server_address[1]}", retries=2, backoff_s=0.01)
    try:
        if cuts == 1:
            assert client.get_progress().step == 3
        else:
            with pytest.raises(RelayUnreachable) as raised:
                client.get_progress()
            assert "cut off mid-way" in raised.value.message and "after 3 tries" in raised.value.message
    finally:
        client.close()
    assert CuttingServer.served.count("progress") == (2 if cuts == 1 else 3), CuttingServer.served
