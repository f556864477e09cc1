"""What a newcomer meets when the relay URL is wrong, or a shell peer has no token: each message
says what happened and what to do (asserted by text, not just by type)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relay_server.harness import zygote
from toolkit.client import RelayClient
from toolkit.errors import NOT_A_RELAY_HINT, ProtocolError, RelayRejected, RelayUnreachable, RelayUrlError

REPO = Path(__file__).resolve().parent.parent


def test_a_web_page_is_not_taken_for_a_relay(web_page: str) -> None:
    client = RelayClient(web_page, retries=0)
    with pytest.raises(ProtocolError) as page:
        client.get_run()
    assert page.value.code == "not_a_relay" and page.value.hint == NOT_A_RELAY_HINT
    assert page.value.message == (
        f"{web_page}/api/run answered HTTP 200 with a web page, not the relay's JSON: is this a collabtrain relay?"
    )
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


def test_a_relay_address_with_a_path_says_which_address_to_use(serve_relay) -> None:
    relay = serve_relay()
    for wrong in (relay.url + "/dashboard", relay.url + "/api/run"):
        client = RelayClient(wrong, retries=0)
        with pytest.raises(RelayUrlError) as path:
            client.get_run()
        assert path.value.code == "wrong_path"
        assert path.value.message == f"{wrong} is not the relay's address: the relay answers at {relay.url}"
        assert path.value.hint == (
            f"Use {relay.url} as the relay URL (set RELAY_URL, or ask the organizer for a fresh notebook)."
        )
        client.close()


def test_shell_peer_without_a_token_says_how_to_give_one(serve_relay, hf_standin) -> None:
    relay = serve_relay({"auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": ["alice"]}})
    done = zygote.run(
        [
            sys.executable,
            "-m",
            "toolkit.peer",
            "--relay",
            relay.url,
            "--token-env",
            "NO_SUCH_VAR",
            "--max-seconds",
            "5",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 1
    assert "needs a Hugging Face login" in done.stderr
    assert (
        "From a shell: export HF_TOKEN=... (python -m toolkit.peer --token-env NAME reads another variable)"
        in done.stderr
    )


def test_shell_peer_logs_in_with_the_token_its_variable_holds(serve_relay, hf_standin) -> None:
    hf_standin.add_user("hf_alice_token_123456", "alice")
    relay = serve_relay(
        {
            "auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": ["alice"]},
            "run": {"target_batch": 8},
            "dataset": {"kind": "demo_corpus"},
            "model": {
                "factory": "toolkit.models:ByteTransformer",
                "kwargs": {"seq_len": 16, "d_model": 32, "n_layer": 1, "n_head": 2, "d_ff": 64},
            },
        }
    )
    env = {**os.environ, "MY_HF_TOKEN": "hf_alice_token_123456"}
    done = zygote.run(
        [sys.executable, "-m", "toolkit.peer", "--relay", relay.url, "--token-env", "MY_HF_TOKEN", "--max-steps", "2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"contributed_samples": ' in done.stdout and '"contributed_samples": 0' not in done.stdout
    assert "hf_alice_token_123456" not in done.stdout + done.stderr  # the token is never printed


# --- what a volunteer meets later: relay down, login refused, run over, device full -----------
TINY_BYTE_LM = {
    "run": {"target_batch": 8},
    "dataset": {"kind": "demo_corpus"},
    "model": {
        "factory": "toolkit.models:ByteTransformer",
        "kwargs": {"seq_len": 16, "d_model": 32, "n_layer": 1, "n_head": 2, "d_ff": 64},
    },
}


def shell_peer(relay_url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return zygote.run(
        [sys.executable, "-m", "toolkit.peer", "--relay", relay_url, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


def test_a_relay_that_is_down_says_nothing_listens_and_that_a_restart_is_retried(closed_url: str) -> None:
    url = closed_url
    client = RelayClient(url, retries=1, backoff_s=0.01)
    with pytest.raises(RelayUnreachable) as down:
        client.get_run()
    assert down.value.message == (
        f"no answer from the relay at {url} (connection refused: nothing listens there) after 2 tries (GET /api/run)"
    )
    assert down.value.hint == (
        "A relay that is restarting answers again within seconds: a running peer keeps "
        "retrying and goes on by itself. Otherwise: Check the relay URL, that the relay is "
        "running, and that this notebook has internet access (Kaggle: Settings -> Internet on)."
    )
    client.close()


@pytest.mark.parametrize(
    "token, code, message",
    [
        (
            "hf_expired_or_wrong_token",
            "invalid_hf_token",
            "Hugging Face rejected the token (wrong, expired or revoked)",
        ),
        ("hf_mallory_token_123456", "not_allowlisted", "Hugging Face user 'mallory' is not allowed to join this run"),
    ],
)
def test_a_refused_login_says_why_and_what_to_do(serve_relay, hf_standin, token: str, code: str, message: str) -> None:
    hf_standin.add_user("hf_mallory_token_123456", "mallory")
    relay = serve_relay({"auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": ["alice"]}})
    done = shell_peer(relay.url, "--max-seconds", "5", env={"HF_TOKEN": token})
    assert done.returncode == 1
    assert f"[{code}] {message}" in done.stderr
    hint = {
        "invalid_hf_token": "Create a read token at https://huggingface.co/settings/tokens, put it in the "
        "HF_TOKEN secret (notebook) or variable (shell), and run again.",
        "not_allowlisted": "Ask the organizer to add your username, or join the run's organization on huggingface.co.",
    }[code]
    assert hint in done.stderr
    assert token not in done.stderr  # the token is never echoed back


def test_joining_a_finished_run_says_so_instead_of_contributing_nothing(serve_relay) -> None:
    relay = serve_relay({**TINY_BYTE_LM, "run": {"target_batch": 8, "total_steps": 1}})
    first = shell_peer(relay.url, "--max-steps", "1")
    assert first.returncode == 0, first.stderr[-2000:]
    late = shell_peer(relay.url, "--max-steps", "1")
    assert late.returncode == 1
    assert (
        "[run_finished] run 'test-run' already finished at step 1: there is nothing left to contribute" in late.stderr
    ), late.stderr
    assert "ask the organizer for the address of their next run" in late.stderr


def test_a_micro_batch_too_large_for_the_device_names_the_batch_size_to_lower(serve_relay) -> None:
    """A real allocation failure: the batch is a stride-0 view of one sequence, so it costs nothing
    until the model's embedding output needs terabytes."""
    import torch

    from toolkit import join
    from toolkit.errors import DeviceOutOfMemory
    from toolkit.runtime import environment

    relay = serve_relay(TINY_BYTE_LM)
    huge = torch.zeros(1, 16, dtype=torch.long).expand(2**33, 16)
    with pytest.raises(DeviceOutOfMemory) as full:
        join(relay.url, data=[huge], panel="none", max_steps=1)
    device = environment.detect().label  # e.g. "Intel(R) Xeon(R) Processor (cpu, 23.5 GiB)"
    assert full.value.message == f"the {device} ran out of memory on a micro-batch of {2**33} samples"
    assert full.value.hint.startswith(
        "Join again with a smaller batch: toolkit.join(..., batch_size=N) or python -m toolkit.peer --batch-size N"
    )
