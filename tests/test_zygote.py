"""``relay_server.harness.zygote``: a child forked from the zygote is what a fresh interpreter
would have been (argv, ``sys.path``, environment, working directory, stdio, exit status), is this
process's own child (waited on, killed), and launches a fork cannot reproduce are exec'd fresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay_server.harness import zygote

pytestmark = pytest.mark.integration  # starts processes

REPORT = """
import json, os, sys
import numpy, torch
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "path": sys.path[1:], "cwd": os.getcwd(),
    "env": os.environ.get("ZYGOTE_PROBE"), "main": __name__, "ppid": os.getppid(),
    "numpy": float(numpy.random.rand()), "threads": torch.get_num_threads(), "seed": torch.initial_seed(),
}))
"""


@pytest.fixture
def forks() -> zygote.Zygote:
    """This process's zygote (conftest enabled it), with its count of launches before the test."""
    started = zygote.current()
    if started is None:
        pytest.skip("the zygote is off (COLLABTRAIN_TEST_ZYGOTE=0, or not Linux)")
    return started


def report(argv: list[str], *, fork: bool, **kwargs: object) -> dict:
    run = zygote.run if fork else subprocess.run
    done = run(argv, capture_output=True, text=True, timeout=120, **kwargs)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_forked_script_module_and_command_see_what_a_fresh_interpreter_sees(
    forks: zygote.Zygote, tmp_path: Path
) -> None:
    script = tmp_path / "probe.py"
    script.write_text(REPORT)
    (tmp_path / "probe_module.py").write_text(REPORT)
    env = {**os.environ, "ZYGOTE_PROBE": "yes"}
    for argv in (
        [sys.executable, str(script), "a", "b"],
        [sys.executable, "-m", "probe_module", "c"],
        [sys.executable, "-c", REPORT, "d"],
    ):
        before = forks.launches
        forked = report(argv, fork=True, cwd=tmp_path, env=env)
        assert forks.launches == before + 1, "this launch should have been forked"
        fresh = report(argv, fork=False, cwd=tmp_path, env=env)
        assert forked.pop("ppid") == os.getpid()  # this process's own child, not the zygote's
        assert forked.pop("numpy") != fresh.pop("numpy")  # seeded from the OS in each, not shared
        assert forked.pop("seed") != fresh.pop("seed")
        fresh.pop("ppid")
        assert forked == fresh
        assert forked["env"] == "yes" and forked["main"] == "__main__" and forked["cwd"] == str(tmp_path)


def test_two_forked_children_draw_different_random_numbers(forks: zygote.Zygote) -> None:
    code = "import random, numpy, torch; print(random.random(), numpy.random.rand(), torch.rand(1).item())"
    first, second = (zygote.run([sys.executable, "-c", code], capture_output=True, text=True) for _ in range(2))
    for one, other in zip(first.stdout.split(), second.stdout.split(), strict=True):
        assert one != other  # random, numpy and torch: each seeded from the OS, as a fresh process


def test_exit_status_exceptions_and_open_files_are_those_of_a_fresh_interpreter(
    forks: zygote.Zygote, tmp_path: Path
) -> None:
    for code, status, stderr in (
        ("import sys; sys.exit(3)", 3, ""),
        ("raise SystemExit('config: run.name is missing')", 1, "config: run.name is missing\n"),
        ("raise ValueError('boom')", 1, "ValueError: boom\n"),
        ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt\n"),
    ):
        done = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == fresh.returncode == status, (code, done.stderr)
        assert done.stderr.endswith(stderr) and fresh.stderr.endswith(stderr)
    # What the interpreter's exit does: non-daemon threads joined, atexit run, files left open flushed.
    code = (
        "import atexit, threading, time, sys\n"
        f"kept = open({str(tmp_path / 'kept.txt')!r}, 'w'); kept.write('unflushed')\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n"
        "atexit.register(print, 'atexit')\nsys.stdout.write('main ')\n"
    )
    done = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "main thread\natexit\n")
    assert (tmp_path / "kept.txt").read_text() == "unflushed"


def test_a_forked_child_is_killed_and_waited_on_like_any_child(forks: zygote.Zygote, tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    before = forks.launches
    with open(log, "w") as out:
        child = zygote.Popen(
            [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    assert forks.launches == before + 1
    zygote_wait = zygote.run([sys.executable, "-c", "print('second')"], capture_output=True, text=True)
    assert zygote_wait.stdout == "second\n"
    assert child.poll() is None
    assert b"time.sleep(600)" in Path(f"/proc/{child.pid}/cmdline").read_bytes()  # what ps shows: its command
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert log.read_text() == "up\n"


def test_a_forked_child_stuck_at_exit_writes_its_threads_stacks_when_ended(
    forks: zygote.Zygote, tmp_path: Path
) -> None:
    """What a shutdown hang in CI leaves behind: the harness ends a process that outlived its
    signal with SIGABRT (``dump_stacks_and_kill``) and, the suite's processes running with
    ``PYTHONFAULTHANDLER=1`` (conftest), every thread's stack is in its log, a forked one's too."""
    from relay_server.harness.process import stop_process

    assert os.environ.get("PYTHONFAULTHANDLER") == "1"
    log = tmp_path / "child.log"
    stuck = (
        "import signal, threading, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: None)  # a shutdown that never comes\n"
        "def waits_forever():\n"
        "    threading.Event().wait()\n"
        "threading.Thread(target=waits_forever, name='waiter').start()\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    before = forks.launches
    with open(log, "w") as out:
        child = zygote.Popen([sys.executable, "-c", stuck], stdout=out, stderr=subprocess.STDOUT)
    assert forks.launches == before + 1
    while "up" not in log.read_text():
        assert child.poll() is None, log.read_text()
        time.sleep(0.05)
    stop_process(child, timeout_s=1)
    assert child.returncode == -signal.SIGABRT
    text = log.read_text()
    assert "Fatal Python error: Aborted" in text, text
    assert 'File "<string>", line 4 in waits_forever' in text, text  # each thread, where it waits
    assert 'File "<string>", line 7 in <module>' in text, text
    assert text.count("Thread 0x") + text.count("Current thread 0x") == 2, text


def test_launches_this_zygote_cannot_reproduce_are_not_its_forks(forks: zygote.Zygote) -> None:
    before = forks.launches
    done = zygote.run(
        [sys.executable, "-X", "utf8", "-c", "import sys; print(sys.flags.utf8_mode)"], capture_output=True
    )
    assert done.stdout == b"1\n"  # an interpreter option: honoured by a fresh interpreter
    done = zygote.run(
        [sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"],
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # read when torch is imported: another zygote's
    )
    assert done.stdout == b"1\n"
    done = zygote.run(["/bin/echo", "not python"], capture_output=True)
    assert done.stdout == b"not python\n"
    assert forks.launches == before


def test_what_torch_sets_for_its_compiler_forks_from_a_zygote_started_under_it(forks: zygote.Zygote) -> None:
    """torch sets ``TORCHINDUCTOR_CACHE_DIR`` in the launcher once anything there compiled; the
    zygote preloaded the compiler (through transformers' ``modeling_utils``), which reads it when
    imported, so such a launch forks from a zygote of its own, not from this one."""
    before, launches = forks.launches, dict(zygote.LAUNCHES)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"/tmp/inductor-{os.getpid()}"}  # new to this launcher
    code = "import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    for _ in range(2):  # the first under a new environment execs fresh; the second starts its zygote
        done = zygote.run([sys.executable, "-c", code], capture_output=True, env=env)
        assert done.stdout == f"/tmp/inductor-{os.getpid()}\n".encode()
    assert forks.launches == before
    assert zygote.LAUNCHES == {"forked": launches["forked"] + 1, "fresh": launches["fresh"] + 1}


HUB = """
import json, sys
import huggingface_hub.constants as hub
import transformers.utils.hub as hf
from transformers.utils import logging
print(json.dumps({
    "home": hub.HF_HOME, "cache": hub.HF_HUB_CACHE, "offline": hub.HF_HUB_OFFLINE, "hf_offline": hf.is_offline_mode(),
    "verbosity": logging.get_verbosity(), "preloaded": "transformers.modeling_utils" in sys.modules,
}))
"""


def test_a_child_under_other_hugging_face_variables_reports_what_a_fresh_one_does(
    forks: zygote.Zygote, tmp_path: Path
) -> None:
    """huggingface_hub and transformers (preloaded) read ``HF_HOME``, ``HF_HUB_OFFLINE``,
    ``TRANSFORMERS_VERBOSITY``... once, when imported: a child launched under other values sees
    them, as a fresh interpreter does (it forks from a zygote started under them)."""
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    launches = dict(zygote.LAUNCHES)
    first = report([sys.executable, "-c", HUB], fork=True, env=env)  # a new environment: exec'd fresh
    forked = report([sys.executable, "-c", HUB], fork=True, env=env)  # the second: its own zygote's fork
    assert zygote.LAUNCHES == {"forked": launches["forked"] + 1, "fresh": launches["fresh"] + 1}
    fresh = report([sys.executable, "-c", HUB], fork=False, env=env)
    assert first == fresh
    assert forked.pop("preloaded") and not fresh.pop("preloaded")
    assert forked == fresh
    assert forked["home"] == str(tmp_path / "hf") and forked["offline"] is True
    plain = report([sys.executable, "-c", HUB], fork=True)  # this zygote's own environment: unchanged
    assert plain["home"] != forked["home"]


def test_a_variable_the_preloaded_modules_read_that_the_launcher_did_not_name_is_exec_d_fresh(
    tmp_path: Path,
) -> None:
    """The zygote notes each variable its imports looked up and refuses a launch that differs in
    one (the launcher then execs it): a fork would keep what the import made of the old value."""
    (tmp_path / "reads_at_import.py").write_text("import os\nSEEN = os.environ.get('ZYGOTE_READ_AT_IMPORT')\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "ZYGOTE_READ_AT_IMPORT": "zygote's",
    }
    own = zygote.Zygote(env, preload=("reads_at_import",))
    try:
        code = "import reads_at_import; print(reads_at_import.SEEN)"
        with pytest.raises(zygote.ZygoteFailed, match="ZYGOTE_READ_AT_IMPORT"):
            own.spawn(["python", "-c", code], {**env, "ZYGOTE_READ_AT_IMPORT": "child's"}, "/", (0, 1, 2), False)
        read, write = os.pipe()
        pid = own.spawn(["python", "-c", code], env, "/", (0, write, 2), False)
        os.close(write)
        assert os.waitpid(pid, 0)[1] == 0
        with os.fdopen(read) as out:
            assert out.read() == "zygote's\n"  # the same value: forked
        assert own.launches == 1
    finally:
        own.close()
