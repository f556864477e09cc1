"""Python processes started without paying for ``import torch`` each time: a pre-forked launcher.

Every relay, aggregator, peer, stage worker and expert host a test starts is ``python -m ...`` or
``python script.py``, and each spends seconds importing torch, numpy and aiohttp before its first
line runs; the suite starts a hundred of them. A *zygote* is one long-lived process (per process
that launches: an xdist worker, a benchmark) that has imported those once and forks a child per
launch. The child then becomes what a fresh interpreter would have been: the requested argv
(``sys.argv``, ``sys.path[0]``), environment, working directory, stdin/stdout/stderr, and runs the
script or module as ``__main__``; when that ends the interpreter exits the normal way (non-daemon
threads joined, ``atexit``, buffers flushed; ``SystemExit``'s code or 1 on an uncaught exception).

The child is a real process and the launcher's own child: the zygote double-forks while the
launcher is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``), so the grandchild is reparented
to the launcher, which ``waitpid``s, signals and kills it exactly as a :class:`subprocess.Popen`
child (:class:`Popen` *is* one: only how the child comes to life differs). A test that kills a
peer with SIGKILL, or reads a crash's exit code, sees what it saw before.

What a fork cannot change is refused, and the launch then execs a fresh interpreter as always:
another executable, interpreter options (``-u``, ``-X``), ``preexec_fn``, ``pass_fds``, user or
group changes, and an environment that differs from the zygote's in a variable that the preloaded
modules read when imported (:data:`IMPORT_TIME_ENV`: ``PYTHON*``, ``OMP_*``, ``TORCH_*``, ``HF_*``...,
and any other the zygote saw its imports look up).
Nothing else is inherited from the zygote: it imports no module of this project (it runs
:mod:`.zygote_main` as a script, so the child imports ``relay_server``/``toolkit`` from its own
``sys.path``), it never ran a torch operation (so no intra-op thread pool exists to be forked), and the child reseeds what a
fresh process seeds from the OS (``random`` does so itself at fork; numpy's and torch's global
generators here).

Off unless :func:`enable` was called (the test suite's ``conftest`` does): a process that starts
one relay gains nothing from a zygote.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

PRELOAD = ("torch", "numpy", "aiohttp", "requests", "transformers", "transformers.modeling_utils")
"""What the zygote imports once: what every launched process imports first, and the bulk of its
start-up (``import torch`` alone is ~1.3 s of a ~2 s start here). transformers' model classes
(``modeling_utils`` pulls in torch's compiler stack, sympy, scipy and accelerate: ~3.5 s of CPU)
are what most stage workers and Hugging Face peers import next."""

IMPORT_TIME_ENV = re.compile(
    r"^(PYTHON|LC_|LANG$|LANGUAGE$|OMP_|KMP_|MKL_|GOMP_|OPENBLAS|GOTO|NUMEXPR|NPY_|NUMPY_|TORCH|PYTORCH|CUDA|NVIDIA|"
    r"LD_|MALLOC|ATEN_|DNNL_|ONEDNN_|XDG_|HOME$|TMPDIR$|TEMP$|TMP$|AIOHTTP_|YARL_|MULTIDICT_|PROPCACHE_|"
    r"FROZENLIST_|REQUESTS_|CURL_CA_BUNDLE$|SSL_CERT|HF_|HUGGINGFACE_|TRANSFORMERS_|TOKENIZERS_|ACCELERATE_|"
    r"SAFETENSORS_|USE_|SYMPY_|MPMATH_|SCIPY_|TQDM_|INDUCTOR_|AOT_|AOTINDUCTOR_|DISABLE_TELEMETRY$|DO_NOT_TRACK$)"
)
"""Variables the preloaded modules (or the interpreter's start-up) may read when imported: a launch
whose environment differs from the zygote's in one of these goes to a zygote started under its
own environment. The zygote itself also notes every variable its imports looked up and refuses a
launch that differs in one this list missed (that launch is then exec'd fresh): this list is how
such launches still fork, the zygote's check is what keeps a fork exact. torch's compiler stack is
among the preloaded modules (through ``modeling_utils``), so ``TORCHINDUCTOR_*`` count too: torch
sets ``TORCHINDUCTOR_CACHE_DIR`` in a launcher once anything there compiled, and its children then
fork from a zygote started under it."""

START_TIMEOUT_S = 300
"""How long a launch waits for the zygote's answer (its imports, the first time) before the zygote
is given up for a fresh interpreter."""

TITLE_ROOM = "--title-room" + " " * 4000
"""The zygote's last argument: room in its command line's memory for each child to write its own
there (``zygote_main._retitle``), so that ``ps`` shows ``python -m relay_server.cli serve ...``."""

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
MESSAGE = 1 << 20
"""The largest launch request: ``zygote_main.MESSAGE`` (the zygote imports nothing of ours)."""


class ZygoteFailed(RuntimeError):
    """The zygote died or refused; the launch falls back to a fresh interpreter."""


def _prctl(option: int, value: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(
        ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)
    ):
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")
    return 0


class Zygote:
    """One zygote process and the socket to it; :meth:`spawn` is serialized by a lock (one fork
    at a time, and the subreaper window is this process's)."""

    def __init__(self, env: dict[str, str], preload: Sequence[str] = PRELOAD) -> None:
        self.env = env  # what the zygote imported under: compared on each launch
        self.lock = threading.Lock()
        self.log = Path(tempfile.mkstemp(prefix="collabtrain-zygote-", suffix=".log")[1])
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("zygote_main.py")),
                    str(theirs.fileno()),
                    *preload,
                    TITLE_ROOM,
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
                env=self.env,
            )
        theirs.close()
        self.sock = ours
        self.sock.settimeout(START_TIMEOUT_S)
        self.launches = 0

    def eligible(self, argv: list[str], env: dict[str, str]) -> bool:
        """Whether a fork of the zygote is what ``argv`` under ``env`` would have been."""
        if self.proc.poll() is not None or not _forkable(argv):
            return False
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return not any(IMPORT_TIME_ENV.match(k) for k in changed)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: tuple[int, int, int], setsid: bool) -> int:
        """Fork a child running ``argv[1:]`` as a fresh interpreter would; its pid (this process's
        child). :class:`ZygoteFailed` if the zygote is gone or refused (it says why)."""
        request = json.dumps({"argv": argv[1:], "env": env, "cwd": cwd, "setsid": setsid}).encode()
        if len(request) > MESSAGE:
            raise ZygoteFailed("launch request too large")
        with self.lock:
            was = ctypes.c_int(0)
            _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.addressof(was))
            _prctl(_PR_SET_CHILD_SUBREAPER, 1)
            try:
                socket.send_fds(self.sock, [request], list(fds))
                answer = self.sock.recv(MESSAGE)  # the first waits for the zygote's imports
            except OSError as error:  # a timeout too: the protocol is out of step, so this one is done
                self.proc.kill()
                raise ZygoteFailed(f"zygote unreachable: {error}") from None
            finally:
                if not was.value:
                    _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        if not answer:
            raise ZygoteFailed(f"zygote exited:\n{self.log.read_text(errors='replace')[-2000:]}")
        reply = json.loads(answer)
        if "pid" not in reply:
            raise ZygoteFailed(reply.get("error", "zygote refused"))
        self.launches += 1
        return int(reply["pid"])

    def close(self) -> None:
        self.sock.close()  # the zygote exits on end of file
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.unlink(missing_ok=True)


LAUNCHES = {"forked": 0, "fresh": 0}
"""This process's launches through :class:`ZygotePopen`: forked from the zygote, or exec'd fresh
(the zygote off, or the launch one a fork cannot reproduce); the test suite prints the sum."""

MAX_ZYGOTES = 3
"""Zygotes kept at once, one per environment that differs in :data:`IMPORT_TIME_ENV` (a library
that set such a variable in the launcher for its children, a test's own); the one with the fewest
launches goes first (a test-scoped ``HF_HOME``'s, not the one most tests launch under)."""

_zygotes: dict[tuple[tuple[str, str], ...], Zygote] = {}
_launches_under: dict[tuple[tuple[str, str], ...], int] = {}
_enabled = False
_owner = 0


def _signature(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if IMPORT_TIME_ENV.match(k)))


def enable() -> None:
    """Launch eligible Python processes by forking a zygote from now on (Linux only; a no-op
    elsewhere). A zygote starts on the first launch under an environment (as far as the preloaded
    modules read it), under that environment."""
    global _enabled
    if sys.platform == "linux" and not _enabled:
        _enabled = True
        atexit.register(shutdown)


@contextlib.contextmanager
def fresh() -> Iterator[None]:
    """Within it, launches exec a fresh interpreter: for a test that measures a process itself
    (its peak RSS counts the pages a forked child shares with the zygote, which a fresh one does
    not have)."""
    global _enabled
    was, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = was


def shutdown() -> None:
    """Stop this process's zygotes, if any (also at exit)."""
    if _owner == os.getpid():
        for zygote in _zygotes.values():
            zygote.close()
    _zygotes.clear()


def current(env: dict[str, str] | None = None, *, one_off_fresh: bool = False) -> Zygote | None:
    """The zygote for launches under ``env`` (this process's environment by default), started on
    first use; None unless :func:`enable` was called. With ``one_off_fresh`` (a launch), the first
    launch under an environment other than the first zygote's gets None (it execs fresh): a test
    that scopes ``HF_HOME`` or ``HF_ENDPOINT`` to itself often starts one process under it, and a
    zygote (torch and transformers imported) costs more than one fresh interpreter; the second
    launch under it starts its zygote."""
    global _owner
    if not _enabled:
        return None
    if _owner != os.getpid():  # a forked launcher starts its own
        _zygotes.clear()
        _launches_under.clear()
        _owner = os.getpid()
    env = dict(os.environ) if env is None else env
    key = _signature(env)
    _launches_under[key] = _launches_under.get(key, 0) + 1
    zygote = _zygotes.get(key)
    if zygote is None or zygote.proc.poll() is not None:
        _zygotes.pop(key, None)
        if one_off_fresh and _launches_under[key] == 1 and (_zygotes or len(_launches_under) > 1):
            return None
        if len(_zygotes) >= MAX_ZYGOTES:
            _zygotes.pop(min(_zygotes, key=lambda k: _launches_under[k])).close()
        zygote = _zygotes[key] = Zygote(env)
    return zygote


def _forkable(argv: list[str]) -> bool:
    """Whether ``argv`` is this interpreter running a script, ``-m`` or ``-c``, with no options."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if argv[1] in ("-m", "-c"):
        return len(argv) >= 3
    return not argv[1].startswith("-")  # interpreter options: a fresh interpreter honours them


class ZygotePopen(subprocess.Popen[Any]):
    """:class:`subprocess.Popen`, whose eligible Python children are forked from the zygote (see
    the module's docstring) rather than exec'd; everything else (pipes, ``wait``, signals,
    ``returncode``) is ``Popen``'s own, on a real child process."""

    def _execute_child(
        self,
        args: Any,
        executable: Any,
        preexec_fn: Any,
        close_fds: bool,
        pass_fds: Sequence[int],
        cwd: Any,
        env: Any,
        startupinfo: Any,
        creationflags: int,
        shell: bool,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        *rest: Any,  # restore_signals, gid, gids, uid, umask, start_new_session, process_group
    ) -> None:
        argv = [os.fsdecode(a) for a in args] if isinstance(args, (list, tuple)) else None
        plain = (
            argv is not None
            and _forkable(argv)
            and not shell
            and executable is None
            and preexec_fn is None
            and not pass_fds
            and rest[1:4] == (None, None, None)  # gid, gids, uid
            and rest[4] < 0  # umask
            and (len(rest) < 7 or rest[6] == -1)  # process_group
        )
        environ = {os.fsdecode(k): os.fsdecode(v) for k, v in (env if env is not None else os.environ).items()}
        zygote = current(environ, one_off_fresh=True) if plain else None
        if zygote is not None and argv is not None and zygote.eligible(argv, environ):
            fds = (
                p2cread if p2cread != -1 else 0,
                c2pwrite if c2pwrite != -1 else 1,
                errwrite if errwrite != -1 else 2,
            )
            try:
                self.pid = zygote.spawn(argv, environ, os.fsdecode(cwd) if cwd else os.getcwd(), fds, bool(rest[5]))
            except ZygoteFailed:
                pass  # exec it fresh, below
            else:
                LAUNCHES["forked"] += 1
                self._child_created = True
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]  # CPython's: closes the child's ends
                return
        LAUNCHES["fresh"] += 1
        super()._execute_child(  # type: ignore[misc]  # typeshed does not declare this CPython method
            args,
            executable,
            preexec_fn,
            close_fds,
            pass_fds,
            cwd,
            env,
            startupinfo,
            creationflags,
            shell,
            p2cread,
            p2cwrite,
            c2pread,
            c2pwrite,
            errread,
            errwrite,
            *rest,
        )


Popen = ZygotePopen
"""The name launch sites use: ``zygote.Popen`` where they said ``subprocess.Popen``."""


def run(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """:func:`subprocess.run` through :class:`Popen` (same arguments, same result)."""
    check = kwargs.pop("check", False)
    given = kwargs.pop("input", None)
    timeout = kwargs.pop("timeout", None)
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if given is not None:
        kwargs["stdin"] = subprocess.PIPE
    with ZygotePopen(*args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(given, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done
