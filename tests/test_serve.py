"""``relay-server serve`` as an organizer starts it: its first lines say where the dashboard is
and which command comes next, and ``--port 0`` says which port it bound (the harness relies on it)."""

from __future__ import annotations

import requests


def test_serve_says_where_the_dashboard_is_and_what_to_run_next(start_relay) -> None:
    relay = start_relay()  # relay-server serve --port 0 --ready-file ...: the bound port is read back
    assert relay.port != 0
    lines = relay.log_path.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("relay-server: listening on"))
    assert lines[first : first + 3] == [
        f"relay-server: listening on {relay.url}; the dashboard is at {relay.url}/",
        "next, behind your HTTPS proxy, write the notebook volunteers open:",
        "  relay-server notebook colab --url https://<your public address> -o run.ipynb",
    ]
    assert sum(line.startswith("relay-server: listening on") for line in lines) == 1
    page = requests.get(relay.url + "/", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()  # the announced URL is the dashboard
