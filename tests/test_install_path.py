"""How a volunteer gets the toolkit: from the run's relay, pinned by sha256, never by bare name.

The relay writes a reproducible wheel of the toolkit it runs and serves it; ``relay-server
notebook`` writes the organizer's notebook with that wheel's name and sha256 filled in; the
notebook, executed headlessly in a FRESH virtualenv (no collabtrain in it, no package index),
installs exactly that wheel from the relay and contributes; a wheel swapped on the relay's disk
makes the same notebook stop with the hash message. The fresh venv sees this venv's
site-packages through a ``.pth`` path line (torch, transformers, ipykernel resolve without a
network), but not this venv's editable collabtrain finder: ``.pth`` files in a directory added
that way are not processed, so ``import toolkit`` can only come from what the notebook installed.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import http.server
import io
import json
import os
import re
import subprocess
import sys
import sysconfig
import threading
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import requests
import yaml
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from relay_server.cli import main
from relay_server.core.distribution import build_wheel_bytes, ensure_wheel, installed_distribution
from relay_server.core.typed import ConfigError
from relay_server.notebooks import PLATFORMS, ToolkitPin, fetch_pin, generated_block, render, template
from tests.support.notebooks import MAX_STEPS, code_cells, kernel_env, kernel_spec_manager, outputs_text
from tests.support.processes import REPO
from tests.support.relays import TINY_LM, running_relay, status
from toolkit import join
from toolkit.errors import MESSAGES

# one worker builds its fresh virtualenv, generated notebook and finished relay once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("install_path")

HASH_MESSAGE = "serves a different toolkit than this notebook pins"


def said(code: str, **fields: object) -> list[str]:
    """The two lines the notebook stops with: MESSAGES[code] filled in."""
    what, todo = (text.format(**fields) for text in MESSAGES[code])
    return [f"[{code}] {what}", f"What to do: {todo}"]


# --- the wheel -------------------------------------------------------------------------------
@pytest.mark.integration
def test_the_wheel_is_byte_for_byte_reproducible_and_complete(tmp_path: Path) -> None:
    name, data = build_wheel_bytes()
    assert build_wheel_bytes() == (name, data)
    # Another process, another working directory and umask: the same bytes.
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import hashlib, os; os.umask(0o077); "
            "from relay_server.core.distribution import build_wheel_bytes; "
            "print(hashlib.sha256(build_wheel_bytes()[1]).hexdigest())",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert other.stdout.strip() == hashlib.sha256(data).hexdigest()

    dist = installed_distribution()
    assert name == f"collabtrain-{dist.version}-py3-none-any.whl"
    archive = zipfile.ZipFile(io.BytesIO(data))
    entries = archive.infolist()
    names = [e.filename for e in entries]
    assert all(e.date_time == (1980, 1, 1, 0, 0, 0) and e.external_attr >> 16 == 0o100644 for e in entries)
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    info = f"collabtrain-{dist.version}.dist-info"
    assert names[-4:] == [f"{info}/METADATA", f"{info}/WHEEL", f"{info}/entry_points.txt", f"{info}/RECORD"]
    assert names[:-4] == sorted(names[:-4])
    for required in (
        "toolkit/__init__.py",
        "toolkit/assets/demo_corpus.txt",
        "relay_server/api/static/index.html",
        "relay_server/defaults/init.toml",
        "relay_server/defaults/notebooks/colab.ipynb",
        "relay_server/core/distribution.py",
    ):
        assert required in names
    metadata = archive.read(f"{info}/METADATA").decode()
    assert f"Name: {dist.metadata['Name']}\nVersion: {dist.version}\n" in metadata
    assert all(f"Requires-Dist: {r}\n" in metadata for r in dist.requires)
    assert all(f"Provides-Extra: {e}\n" in metadata for e in dist.metadata.get_all("Provides-Extra"))
    assert "relay-server = relay_server.cli:main" in archive.read(f"{info}/entry_points.txt").decode()
    # RECORD names every other file with its hash and size, as pip checks them.
    record = archive.read(f"{info}/RECORD").decode().splitlines()
    assert sorted(line.split(",")[0] for line in record) == sorted(names)
    for line in record[:-1]:
        path, digest, size = line.split(",")
        body = archive.read(path)
        assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
        assert int(size) == len(body)


def test_the_data_dir_keeps_one_wheel_and_an_identical_build_leaves_it_untouched(tmp_path: Path) -> None:
    (tmp_path / "collabtrain-0.0.1-py3-none-any.whl").write_bytes(b"an older relay's wheel")
    wheel = ensure_wheel(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [wheel.filename]
    assert hashlib.sha256(wheel.path.read_bytes()).hexdigest() == wheel.sha256
    written = wheel.path.stat().st_mtime_ns
    assert ensure_wheel(tmp_path) == wheel and wheel.path.stat().st_mtime_ns == written
    wheel.path.write_bytes(b"changed on disk")
    assert ensure_wheel(tmp_path).path.read_bytes() == build_wheel_bytes()[1]  # a restart repairs it


# --- the routes ------------------------------------------------------------------------------
def raw_get(url: str, path: str) -> tuple[int, bytes]:
    """GET ``path`` exactly as written (no client-side normalisation of ``..`` or ``%2F``)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_a_signed_run_serves_its_wheel_without_login_and_nothing_else(start_relay, hf_standin) -> None:
    relay = start_relay({"auth": {"mode": "hf", "hf_endpoint": hf_standin.url, "allow_users": ["alice"]}})
    info = requests.get(relay.url + "/api/toolkit", timeout=10).json()
    wheel = relay.data_dir / "toolkit" / info["wheel"]
    assert info["url"] == f"/toolkit/{info['wheel']}" and info["version"] == installed_distribution().version
    served = requests.get(relay.url + info["url"], timeout=30)  # no pass: pip has none
    assert served.status_code == 200 and hashlib.sha256(served.content).hexdigest() == info["sha256"]
    assert served.content == wheel.read_bytes() == build_wheel_bytes()[1]
    secret = (relay.data_dir / "admin_token").read_bytes().strip()
    for path in (
        "/toolkit/collabtrain-9.9.9-py3-none-any.whl",
        "/toolkit/..%2Fadmin_token",
        "/toolkit/..%2F..%2Fadmin_token",
        "/toolkit/../admin_token",
        "/toolkit/%2E%2E/admin_token",
        f"/toolkit/{info['wheel']}%2F..%2F..%2Fadmin_token",
        "/toolkit/",
    ):
        code, body = raw_get(relay.url, path)
        assert code == 404 and secret not in body, (path, code)
    # A restart rebuilds the same bytes and leaves the file as it was (unless someone edited the
    # checkout meanwhile: then it serves, and names, the new bytes).
    written, before = wheel.stat().st_mtime_ns, build_wheel_bytes()[1]
    relay.stop()
    relay.start()
    again = requests.get(relay.url + "/api/toolkit", timeout=10).json()
    assert again["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    if build_wheel_bytes()[1] == before:
        assert again == info and wheel.stat().st_mtime_ns == written


# --- relay-server notebook -------------------------------------------------------------------
def test_the_shipped_notebooks_are_the_templates_the_generator_fills_in() -> None:
    for platform in PLATFORMS:
        shipped = (REPO / "notebooks" / f"{platform}.ipynb").read_text()
        assert template(platform) == shipped, f"notebooks/{platform}.ipynb drifted from its package template"
        cell = code_cells(nbformat.reads(shipped, as_version=4))[0].source
        default = re.search(r'"COLLAB_RELAY_URL", "([^"]+)"', cell).group(1)
        # The cell holds the toolkit's messages as toolkit/errors.py has them now: rendering changes nothing.
        assert generated_block() in cell, f"notebooks/{platform}.ipynb: run python -m relay_server.notebooks"
        assert render(shipped, ToolkitPin(relay_url=default, wheel="", sha256="")) == shipped
    pin = ToolkitPin(
        relay_url="https://relay.example.net",
        wheel="collabtrain-1.2.3-py3-none-any.whl",
        sha256="ab" * 32,
        extras="hf,peer8bit",
    )
    filled = code_cells(nbformat.reads(render(template("kaggle"), pin), as_version=4))[0].source
    shipped_cell = code_cells(nbformat.reads(template("kaggle"), as_version=4))[0].source
    changed = set(filled.splitlines()) - set(shipped_cell.splitlines())
    assert changed == {
        'RELAY_URL = os.environ.get("COLLAB_RELAY_URL", "https://relay.example.net")  # the run\'s '
        "relay, from its organizer",
        f'TOOLKIT_WHEEL = "{pin.wheel}"  # the toolkit wheel that relay serves and its sha256, filled '
        "in by `relay-server notebook`:",
        f'TOOLKIT_SHA256 = "{pin.sha256}"  # pip installs exactly those bytes or nothing. Empty: the '
        "template, which installs nothing.",
        'TOOLKIT_EXTRAS = "hf,peer8bit"  # what the run needs beside it (hf; hf,peer8bit for 8-bit inner '
        "state), filled in too.",
    }


def test_a_run_with_eight_bit_inner_state_has_its_notebook_install_bitsandbytes(serve_relay) -> None:
    """Local SGD with ``optimizer.state_bits = 8``: the relay names the ``peer8bit`` extra, the
    notebook's one cell asks pip for it, and the relay's wheel provides it (pip would refuse an
    extra the wheel does not declare). Every other run installs ``hf`` alone."""
    local = serve_relay(
        {
            "run": {"mode": "local_sgd", "max_staleness": 0},
            "optimizer": {"name": "adamw", "state_bits": 8},
            "local_sgd": {"inner_steps": 2},
        }
    )
    sync = serve_relay({}, name="sync")
    assert fetch_pin(sync.url).extras == "hf"
    pin = fetch_pin(local.url)
    assert pin.extras == "hf,peer8bit"
    cell = code_cells(nbformat.reads(render(template("colab"), pin), as_version=4))[0].source
    assert 'TOOLKIT_EXTRAS = "hf,peer8bit"' in cell and "collabtrain[{TOOLKIT_EXTRAS}] @" in cell
    metadata = (
        zipfile.ZipFile(io.BytesIO(build_wheel_bytes()[1]))
        .read(f"collabtrain-{installed_distribution().version}.dist-info/METADATA")
        .decode()
    )
    assert "Provides-Extra: peer8bit" in metadata and 'bitsandbytes>=0.50; extra == "peer8bit"' in metadata


@pytest.mark.integration
@pytest.mark.parametrize("extras", ['hf"; import os; os.system("x")  #', "hf,", "HF", "hf peer8bit", 7])
def test_extras_that_are_not_extra_names_never_reach_the_cell(extras) -> None:
    """The extras are written into the cell's Python source: anything but comma-separated
    lowercase names is refused, naming the answer, before a notebook exists."""
    answer = json.dumps({"wheel": "collabtrain-1.2.3-py3-none-any.whl", "sha256": "ab" * 32, "extras": extras})

    class Liar(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(answer.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match="without a wheel name, sha256 and extras"):
            fetch_pin(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()


def test_the_notebook_command_says_what_to_do_when_the_url_is_no_relay(
    tmp_path: Path, web_page: str, closed_url: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run.ipynb"
    down = closed_url
    assert main(["notebook", "local", "--url", down, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the relay at {down}/api/toolkit (connection refused: nothing listens there)" in err
    assert "relay-server serve" in err
    assert main(["notebook", "kaggle", "--local-test", "--url", web_page, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{web_page}/api/toolkit answered HTTP 200 with a web page, not the relay's JSON" in err
    assert "Check the relay URL" in err
    assert main(["notebook", "tpu", "--url", "relay.example.org", "-o", str(out)]) == 2
    assert "--url must be the relay's public http(s) address" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("platform", ["colab", "kaggle", "tpu"])
@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:{port}", "https://localhost:{port}", "https://192.168.1.20:{port}", "http://[::1]:{port}"],
)
def test_a_hosted_notebook_is_refused_an_address_its_platform_cannot_reach(
    tmp_path: Path, capsys: pytest.CaptureFixture, closed_url: str, platform: str, url: str
) -> None:
    port = closed_url.rsplit(":", 1)[1]
    out, url = tmp_path / "run.ipynb", url.format(port=port)  # refused before anything is asked
    assert main(["notebook", platform, "--url", url, "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"relay-server notebook: a {platform} notebook runs on {platform}'s machines, which cannot reach {url} (an "
        f"address of this machine or its network): pass the relay's public https:// address, or --local-test for "
        f"a notebook you run on this machine yourself\n"
    )
    assert not out.exists()


def test_a_hosted_notebook_is_refused_plain_http(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run.ipynb"
    assert main(["notebook", "colab", "--url", "http://relay.example.org", "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        "relay-server notebook: http://relay.example.org is plain http, so a colab notebook would send volunteers' "
        "tokens and gradients across the internet in clear: put the relay behind TLS (README: 'TLS through a reverse "
        "proxy') and pass its https:// address, or --local-test for a notebook you run on this machine yourself\n"
    )
    assert not out.exists()


def test_local_test_and_the_local_kind_may_use_this_machines_relay(
    generated: GeneratedRun, capsys: pytest.CaptureFixture
) -> None:
    for args in (["local"], ["colab", "--local-test"]):
        out = generated.home / f"{args[0]}-test.ipynb"
        assert main(["notebook", *args, "--url", generated.relay_url, "-o", str(out)]) == 0
        said_out = capsys.readouterr().out
        assert (
            f"joins that relay. {'A local test: run it on this machine' if '--local-test' in args else 'Share'}"
            in said_out
        )
        assert f'"COLLAB_RELAY_URL", "{generated.relay_url}"' in code_cells(nbformat.read(out, as_version=4))[0].source


def test_a_finished_run_gets_no_notebook(finished_relay: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run.ipynb"
    assert main(["notebook", "local", "--url", finished_relay, "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"relay-server notebook: run 'demo-byte-lm' at {finished_relay} already finished at step 1, so every "
        f"volunteer opening this notebook would stop at once: raise [run] total_steps and restart the relay, or pass the "
        f"address of the next run's relay\n"
    )
    assert not out.exists()


# --- the generated notebook, in a fresh venv -------------------------------------------------
@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv without collabtrain (nor pip of its own): this venv's site-packages joins its
    path as a plain directory, so dependencies resolve offline but the editable finder stays off."""
    root = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "collab-test-parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('toolkit'))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env=without_checkout(os.environ),
    )
    assert probe.stdout.strip() == "None", "the fresh venv must not see the checkout's collabtrain"
    return python


def without_checkout(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without PYTHONPATH: a checkout on it (as a developer runs the tests) would hand the
    fresh venv the very toolkit it must install."""
    return {key: value for key, value in env.items() if key != "PYTHONPATH"}


@dataclass
class GeneratedRun:
    relay_url: str
    notebook: Path
    wheel: Path
    venv: Path
    specs: KernelSpecManager
    home: Path


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory, fresh_python: Path) -> Iterator[GeneratedRun]:
    """A live relay and the notebook ``relay-server notebook colab`` wrote for it."""
    home = tmp_path_factory.mktemp("organizer")
    with running_relay(home) as relay:
        notebook = home / "my-run.ipynb"
        assert main(["notebook", "colab", "--local-test", "--url", relay.url, "-o", str(notebook)]) == 0
        info = requests.get(relay.url + "/api/toolkit", timeout=10).json()
        specs = kernel_spec_manager(tmp_path_factory.mktemp("kernels"), str(fresh_python), name="fresh")
        yield GeneratedRun(
            relay_url=relay.url,
            notebook=notebook,
            wheel=home / "relay-data" / "toolkit" / info["wheel"],
            venv=fresh_python.parent.parent,
            specs=specs,
            home=home,
        )


@pytest.fixture(scope="module")
def finished_relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A relay whose run (one step) is over: a peer in this process took that step."""
    with running_relay(tmp_path_factory.mktemp("finished"), {"run": {**TINY_LM["run"], "total_steps": 1}}) as relay:
        result = join(relay.url, panel="none", max_steps=1)
        assert result.final_step == 1 and status(relay.url)["finished"], result
        yield relay.url


def execute(
    run: GeneratedRun, relay_url: str | None = None, notebook: str | None = None
) -> tuple[nbformat.NotebookNode, CellExecutionError | None]:
    """The notebook as the organizer wrote it (or ``notebook``'s text), plus a probe cell saying
    where ``toolkit`` came from; ``relay_url`` replaces the notebook's relay (COLLAB_RELAY_URL);
    the kernel's working directory is outside the checkout."""
    nb = nbformat.reads(notebook, as_version=4) if notebook else nbformat.read(run.notebook, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import toolkit; print('TOOLKIT_FROM', toolkit.__file__)"))
    km = AsyncKernelManager(kernel_name="fresh", kernel_spec_manager=run.specs)
    client = NotebookClient(nb, km=km, timeout=240, resources={"metadata": {"path": str(run.home)}})

    async def run_and_shut_down() -> None:
        try:
            await client.async_execute(env=without_checkout(kernel_env(relay_url, run.home)))
        finally:  # nbclient leaves a kernel it was given running: one left per test otherwise
            if km.has_kernel:
                await km.shutdown_kernel(now=True)

    try:
        asyncio.run(run_and_shut_down())
    except CellExecutionError as exc:
        return client.nb, exc
    return client.nb, None


def stopped_with(nb: nbformat.NotebookNode, error: CellExecutionError | None, lines: list[str]) -> None:
    """The cell stopped with exactly ``lines`` (what happened, what to do) and nothing else: no
    traceback, no IPython exit warning, no pip output, and the next cell did not run."""
    assert error is not None and error.ename == "Stop", error
    cell = code_cells(nb)[0]
    assert [o.output_type for o in cell.outputs] == ["error"], cell.outputs
    assert cell.outputs[0].traceback == lines
    text = outputs_text(cell)
    assert text.strip().splitlines() == lines
    assert "Traceback" not in text and "To exit" not in text
    assert not code_cells(nb)[1].outputs  # the cells below did not run


@pytest.mark.integration
def test_the_generated_notebook_installs_the_relays_wheel_into_a_fresh_venv_and_contributes(
    generated: GeneratedRun,
) -> None:
    nb, error = execute(generated)
    text = outputs_text(code_cells(nb)[0])
    assert error is None, f"{error}\n{text}"
    assert re.search(
        rf"Contributed {MAX_STEPS * TINY_LM['run']['target_batch']} samples over {MAX_STEPS} steps "
        r"\(first contribution [\d.]+ s after joining\); left at step",
        text,
    ), text
    where = outputs_text(code_cells(nb)[1])
    assert f"TOOLKIT_FROM {generated.venv}" in where and str(REPO) not in where, where
    assert status(generated.relay_url)["step"] == MAX_STEPS
    assert [e["samples"] for e in status(generated.relay_url)["leaderboard"]] == [
        MAX_STEPS * TINY_LM["run"]["target_batch"]
    ]


@pytest.mark.integration
def test_a_wheel_swapped_on_the_relays_disk_stops_the_same_notebook_with_the_hash_message(
    generated: GeneratedRun,
) -> None:
    original = generated.wheel.read_bytes()
    generated.wheel.write_bytes(original.replace(b"def join(", b"def jo1n(", 1))  # served from disk, as is
    try:
        nb, error = execute(generated)
    finally:
        generated.wheel.write_bytes(original)
    sha256 = fetch_pin(generated.relay_url).sha256  # what the notebook pins
    stopped_with(nb, error, said("toolkit_mismatch", url=generated.relay_url, sha256=sha256))
    assert (
        f"[toolkit_mismatch] the relay at {generated.relay_url} {HASH_MESSAGE} (sha256 {sha256[:12]}...)"
        ": nothing was installed" in error.evalue
    )


@pytest.mark.integration
def test_a_relay_that_does_not_answer_stops_the_cell_before_pip_in_two_lines(
    generated: GeneratedRun, closed_url: str
) -> None:
    down = closed_url  # COLLAB_RELAY_URL overrides the notebook's relay
    nb, error = execute(generated, down)
    stopped_with(nb, error, said("relay_unreachable", url=down, reason="connection refused: nothing listens there"))
    assert error.evalue == (
        f"[relay_unreachable] no answer from the relay at {down} (connection refused: nothing "
        "listens there)\nWhat to do: Check the relay URL, that the relay is running, and that "
        "this notebook has internet access (Kaggle: Settings -> Internet on)."
    )


def test_a_web_page_stops_the_cell_saying_it_is_not_a_relay(generated: GeneratedRun, web_page: str) -> None:
    nb, error = execute(generated, web_page)
    stopped_with(nb, error, said("not_a_relay", url=f"{web_page}/api/status", status=404, kind="a web page"))
    assert error.evalue.startswith(
        f"[not_a_relay] {web_page}/api/status answered HTTP 404 with a web page, not the "
        "relay's JSON: is this a collabtrain relay?\nWhat to do: Check the relay URL"
    )


@pytest.mark.integration
def test_a_relay_address_with_a_path_says_which_address_to_use(generated: GeneratedRun) -> None:
    wrong = generated.relay_url + "/dashboard"
    nb, error = execute(generated, wrong)
    stopped_with(nb, error, said("wrong_path", url=wrong, base=generated.relay_url))
    assert error.evalue.startswith(
        f"[wrong_path] {wrong} is not the relay's address: the relay answers at {generated.relay_url}"
    ), error.evalue


@pytest.mark.integration
def test_a_finished_run_stops_the_cell_before_pip(generated: GeneratedRun, finished_relay: str) -> None:
    nb, error = execute(generated, finished_relay)
    stopped_with(nb, error, said("run_finished", run="demo-byte-lm", step=1))
    assert error.evalue.startswith(
        "[run_finished] run 'demo-byte-lm' already finished at step 1: there is nothing "
        "left to contribute\nWhat to do: Nothing to do here: ask the organizer"
    )


@pytest.mark.integration
def test_a_failed_install_is_one_line_with_pips_output_in_a_named_file(generated: GeneratedRun) -> None:
    """A wheel name the relay does not serve (an old notebook after the relay's upgrade)."""
    pin = fetch_pin(generated.relay_url)
    stale = ToolkitPin(relay_url=pin.relay_url, wheel="collabtrain-0.0.1-py3-none-any.whl", sha256=pin.sha256)
    nb, error = execute(generated, notebook=render(template("colab"), stale))
    assert error is not None and error.ename == "Stop", error
    what, todo = code_cells(nb)[0].outputs[0].traceback
    assert what == (
        f"[install_failed] pip could not install the toolkit from {generated.relay_url}: HTTP error 404 "
        f"while getting {generated.relay_url}/toolkit/{stale.wheel}#sha256={stale.sha256}"
    )
    log = re.fullmatch(
        r"What to do: Check this notebook's internet access \(Kaggle: Settings -> Internet on\) and "
        r"run the cell again; pip's full output is in (\S+)\.",
        todo,
    )
    assert log and "404" in Path(log.group(1)).read_text(), todo
    stopped_with(nb, error, [what, todo])


@pytest.mark.integration
def test_a_machine_without_torch_gets_the_cpu_build(generated: GeneratedRun, tmp_path: Path) -> None:
    """The cell run as a script by a Python without torch (nor pip, so nothing is downloaded):
    it asks pip for the CPU build, and says in one line that pip could not."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    cell = code_cells(nbformat.reads(render(template("local"), fetch_pin(generated.relay_url)), as_version=4))[0]
    done = subprocess.run(
        [str(bare / "bin" / "python"), "-c", cell.source],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1"},
    )
    assert done.returncode == 1 and not done.stdout
    what, todo = done.stderr.strip().splitlines()
    assert what == (
        "[install_failed] pip could not install PyTorch from https://download.pytorch.org/whl/cpu: "
        f"{bare / 'bin' / 'python'}: No module named pip"
    )
    assert todo.startswith("What to do: Check this notebook's internet access")


@pytest.mark.integration
def test_the_shipped_template_installs_nothing_and_says_where_the_runs_notebook_comes_from(tmp_path: Path) -> None:
    bare = tmp_path / "bare"  # no collabtrain and no dependencies: the cell stops before needing any
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    cell = code_cells(nbformat.reads(template("colab"), as_version=4))[0].source
    done = subprocess.run(
        [str(bare / "bin" / "python"), "-c", cell],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1"},
    )
    assert done.returncode == 1 and not done.stdout
    assert (
        done.stderr.strip().splitlines()
        == said("template")
        == [
            "[template] this is the template notebook: it installs nothing",
            "What to do: Open the run's notebook from its organizer (they write it with `relay-server notebook "
            "colab|kaggle|tpu|local --url RELAY_URL -o run.ipynb`, which fills in the relay address and the toolkit's "
            "sha256).",
        ]
    )
    assert not list(bare.rglob("toolkit"))


# --- the release workflow --------------------------------------------------------------------
def test_the_release_workflow_builds_checks_and_publishes_with_trusted_publishing() -> None:
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "release.yml").read_text())
    trigger = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert trigger["push"]["tags"] == ["v*"]
    steps = [step for job in workflow["jobs"].values() for step in job.get("steps", [])]  # not the called ci.yml
    runs = "\n".join(step.get("run", "") for step in steps)
    assert "python -m build" in runs and "twine check --strict dist/*" in runs
    publish = [
        job
        for job in workflow["jobs"].values()
        if any(str(s.get("uses", "")).startswith("pypa/gh-action-pypi-publish@") for s in job.get("steps", []))
    ]
    assert len(publish) == 1 and publish[0]["permissions"]["id-token"] == "write"
    assert "password" not in str(publish[0]) and "secrets." not in str(publish[0])  # no stored token
