"""The zygote process of :mod:`relay_server.harness.zygote`: ``python zygote_main.py FD MODULE...
TITLE_ROOM``. It imports the modules named, then forks a child per launch request read from the
socket ``FD``; the child becomes the process the request describes (:func:`_become`) and exits as
an interpreter would, less the teardown (:func:`_main`).

Run as a script, not as ``-m``: it imports nothing of this project (only the standard library and
the modules it is told to preload), so each child imports ``relay_server``/``toolkit`` itself from
its own ``sys.path``, as a fresh interpreter would.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from typing import Any

MESSAGE = 1 << 20
"""The largest launch request (argv, environment, working directory as JSON); the launcher's too."""


def _serve(sock: socket.socket, looked_up: dict[str, str | None]) -> tuple[dict[str, Any], list[int]]:
    """Answer launch requests until the launcher hangs up (then exit); return only in a forked
    child, with its request and its stdin/stdout/stderr. A request whose environment differs from
    ``looked_up`` (what the preloaded modules read while imported) is refused: a fork would carry what
    they made of the zygote's values, so the launcher execs that one fresh."""
    threads = len(os.listdir("/proc/self/task"))
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE, 3)
        except (ConnectionError, OSError):
            os._exit(0)
        if not data:
            os._exit(0)
        if len(os.listdir("/proc/self/task")) > threads or len(fds) != 3:
            sock.send(json.dumps({"error": "zygote started threads; not forking"}).encode())
            for fd in fds:
                os.close(fd)
            continue
        request = json.loads(data)
        differs = sorted(k for k, v in looked_up.items() if request["env"].get(k) != v)
        if differs:
            sock.send(json.dumps({"error": f"environment differs in {', '.join(differs)}, read at import"}).encode())
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        # The child starts once the middle is gone (reparented to the launcher by then: its
        # getppid() is the launcher's from its first line); the middle's exit takes a while
        # when there is much to unmap, and a child that needs no imports is quick.
        go_read, go_write = os.pipe()
        middle = os.fork()
        if middle == 0:  # the middle child: fork the real one, tell its pid, exit (reparenting it)
            child = os.fork()
            if child == 0:
                os.close(read)
                os.close(write)
                os.close(go_write)
                sock.close()
                os.read(go_read, 1)
                os.close(go_read)
                return request, fds
            os.write(write, str(child).encode())
            os._exit(0)
        os.close(write)
        os.close(go_read)
        pid = os.read(read, 32)
        os.close(read)
        os.waitpid(middle, 0)
        os.write(go_write, b"!")
        os.close(go_write)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": int(pid)} if pid else {"error": "fork failed"}).encode())


def _retitle(argv: list[str]) -> None:
    """Write ``argv`` over this process's command line (``/proc/self/cmdline``, what ``ps`` and
    psutil show), within the room the zygote's own took; left as it is where that is refused."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5) fields 48, 49)
        # As setproctitle(3) does: one line, NUL-padded, the area's last byte not NUL (the kernel
        # then shows up to the first NUL, and psutil splits the line at its spaces).
        title = " ".join(argv).encode()[: end - start - 2]
        with open("/proc/self/mem", "r+b", buffering=0) as memory:
            memory.seek(start)
            memory.write(title + b"\0" * (end - start - len(title) - 1) + b" ")
    except (OSError, ValueError, IndexError):
        pass


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """Turn this fork into the process ``python ARGV`` would have started, then run it."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    if request["setsid"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # A fresh process seeds numpy's global generator and torch's default one from the OS (the
    # zygote never drew from them: each child would otherwise repeat its siblings' numbers).
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    argv = request["argv"]
    _retitle([sys.executable, *argv])
    rest = sys.path[1:]  # sys.path[0] is this script's folder
    if argv[0] == "-m":
        import runpy

        sys.path[:] = [os.getcwd(), *rest]
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in argv[0]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        import types

        sys.path[:] = ["", *rest]
        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        import runpy

        sys.path[:] = [os.path.dirname(os.path.realpath(argv[0])), *rest]
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def _exit_code(error: BaseException) -> int:
    """What the interpreter exits with on ``error`` escaping ``__main__`` (printed as it would)."""
    if isinstance(error, SystemExit):
        if error.code is None or isinstance(error.code, int):
            return error.code or 0
        print(error.code, file=sys.stderr)
        return 1
    sys.excepthook(type(error), error, error.__traceback__)
    return 1


class _Recording(os._Environ[str]):
    """``os.environ`` while the zygote imports (a subclass of its class, ``os._Environ``, which
    typeshed declares): notes each variable looked up (``os.getenv``, ``os.environ.get``/``[]``/
    ``in``), and who listed them all."""

    looked_up: set[str] = set()
    listed_by: list[str] = []

    def __getitem__(self, key: str) -> str:
        if sys._getframe(1).f_code.co_name != "__iter__":  # items()/values() listing: see __iter__
            _Recording.looked_up.add(key)
        return str(super().__getitem__(key))

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            _Recording.looked_up.add(key)
        return bool(super().__contains__(key))

    def __iter__(self) -> Any:
        caller = sys._getframe(1)
        while caller.f_back is not None and caller.f_code.co_filename.startswith("<frozen"):
            caller = caller.f_back  # past the Mapping methods that iterate for items(), copy()...
        _Recording.listed_by.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
        return super().__iter__()


def _preload(names: list[str]) -> dict[str, str | None]:
    """Import ``names``; the variables they looked up while importing, with the values they saw
    (None: unset). Prefix scans (iterating ``os.environ``, as tqdm does for ``TQDM_*``) are written
    to the zygote's log: the launcher's ``IMPORT_TIME_ENV`` names those prefixes."""
    import importlib

    seen = dict(os.environ)
    os.environ.__class__ = _Recording
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        os.environ.__class__ = os._Environ
    if _Recording.listed_by:
        print("the environment was listed while importing, by:", *sorted(set(_Recording.listed_by)), flush=True)
    return {key: seen.get(key) for key in _Recording.looked_up}


def _main() -> None:
    import atexit
    import gc
    import io

    sock = socket.socket(fileno=int(sys.argv[1]))
    read = _preload(sys.argv[2:-1])  # the last is TITLE_ROOM
    gc.freeze()  # the children's collections then skip (and do not copy) what the zygote imported
    request, fds = _serve(sock, read)
    del sock
    interrupted = False
    try:
        _become(request, fds)
        code = 0
    except KeyboardInterrupt as error:
        code, interrupted = _exit_code(error), True
    except BaseException as error:  # noqa: BLE001 (what escapes __main__, as the interpreter reports it)
        code = _exit_code(error)
    # The interpreter's exit, less its teardown of every module and object: in a fork that
    # would copy each page the zygote shares with its children (seconds with torch loaded).
    threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as at exit
    atexit._run_exitfuncs()
    # Files still open would be flushed by that teardown; flush them (the program's own objects:
    # gc.freeze above keeps the zygote's out of get_objects()), then the standard streams.
    for stream in [o for o in gc.get_objects() if isinstance(o, io.IOBase)] + [sys.stdout, sys.stderr]:
        try:
            if not stream.closed:
                stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as the interpreter does: die of SIGINT, so the parent sees -2
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    _main()
