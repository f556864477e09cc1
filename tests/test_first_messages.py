"""What a newcomer meets when the relay URL is wrong, or a shell peer has no token: each message
says what happened and what to do (asserted by text, not just by type)."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from toolkit.client import RelayClient
from toolkit.errors import NOT_A_RELAY_HINT, ProtocolError, RelayRejected, RelayUrlError

REPO = Path(__file__).resolve().parent.parent


class WebPage(http.server.BaseHTTPRequestHandler):
    """A web server that is not a relay: /api/run is an HTML page, everything else a 404 page."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status = 200 if self.path == "/api/run" else 404
        body = b"<!doctype html><html><body><h1>Welcome to nginx!</h1></body></html>"
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def web_page() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), WebPage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_web_page_is_not_taken_for_a_relay(web_page: str) -> None:
    client = RelayClient(web_page, retries=0)
    with pytest.raises(ProtocolError) as page:
        client.get_run()
    assert page.value.code == "not_a_relay" and page.value.hint == NOT_A_RELAY_HINT
    assert page.value.message == (f"{web_page}/api/run answered HTTP 200 with a web page, not the relay's JSON: "
                                  "is this a collabtrain relay?")
    with pytest.raises(RelayRejected) as missing:
        client.get_status()
    assert missing.value.code == "not_a_relay" and missing.value.hint == NOT_A_RELAY_HINT
    assert "answered HTTP 404 with a web page, not the relay's JSON" in missing.value.message
    assert "<html" not in str(missing.value)  # never the raw page as the message
    client.close()


def test_a_url_without_a_scheme_says_so() -> None:
    with pytest.raises(RelayUrlError) as info:
        RelayClient("relay.example.org:8750")
    assert info.value.message == "the relay URL must start with http:// or https://, got 'relay.example.org:8750'"
    assert info.value.hint == NOT_A_RELAY_HINT


def test_shell_peer_without_a_token_says_how_to_give_one(start_relay, hf_standin) -> None:
    relay = start_relay({"auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": ["alice"]}})
    done = subprocess.run([sys.executable, "-m", "toolkit.peer", "--relay", relay.url, "--token-env", "NO_SUCH_VAR",
                           "--max-seconds", "5"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 1
    assert "needs a Hugging Face login" in done.stderr
    assert "From a shell: export HF_TOKEN=... (python -m toolkit.peer --token-env NAME reads another variable)" \
        in done.stderr


def test_shell_peer_logs_in_with_the_token_its_variable_holds(start_relay, hf_standin) -> None:
    hf_standin.add_user("hf_alice_token_123456", "alice")
    relay = start_relay({"auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": ["alice"]},
                         "run": {"target_batch": 8}, "dataset": {"kind": "demo_corpus"},
                         "model": {"factory": "toolkit.models:ByteTransformer",
                                   "kwargs": {"seq_len": 16, "d_model": 32, "n_layer": 1, "n_head": 2, "d_ff": 64}}})
    env = {**os.environ, "MY_HF_TOKEN": "hf_alice_token_123456"}
    done = subprocess.run([sys.executable, "-m", "toolkit.peer", "--relay", relay.url, "--token-env", "MY_HF_TOKEN",
                           "--max-steps", "2"], capture_output=True, text=True, cwd=REPO, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"contributed_samples": ' in done.stdout and '"contributed_samples": 0' not in done.stdout
    assert "hf_alice_token_123456" not in done.stdout + done.stderr  # the token is never printed
