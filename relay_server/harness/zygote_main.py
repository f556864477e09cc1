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


def _serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Answer launch requests until the launcher hangs up (then exit); return only in a forked
    child, with its request and its stdin/stdout/stderr."""
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
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:  # the middle child: fork the real one, tell its pid, exit (reparenting it)
            child = os.fork()
            if child == 0:
                os.close(read)
                os.close(write)
                sock.close()
                return request, fds
            os.write(write, str(child).encode())
            os._exit(0)
        os.close(write)
        pid = os.read(read, 32)
        os.close(read)
        os.waitpid(middle, 0)
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


def _main() -> None:
    import atexit
    import gc
    import importlib
    import io

    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in sys.argv[2:-1]:  # the last is TITLE_ROOM
        importlib.import_module(name)
    gc.freeze()  # the children's collections then skip (and do not copy) what the zygote imported
    request, fds = _serve(sock)
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
