"""Child processes that must not outlive the program that started them (the demo's peers and
expert hosts).

A demo killed outright (SIGKILL, an OOM kill) cannot stop its children, and a peer whose relay is
gone keeps retrying, as a volunteer's should. So the parent names itself in the child's
environment (:func:`child_env`) and the child, first thing in its ``main``, asks Linux to send it
SIGTERM when that parent dies (:func:`die_with_parent`). The child sets this up itself: a
``preexec_fn`` would run Python between fork and exec in a parent with threads (the demo's relay
runs in one), where the child can deadlock on a lock another thread held at the fork.
"""

from __future__ import annotations

import os
import signal
import sys

PARENT_ENV = "COLLAB_DIE_WITH_PARENT"
PR_SET_PDEATHSIG = 1


def child_env() -> dict[str, str]:
    """This process's environment, naming it as the parent its child must not outlive."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """With ``COLLAB_DIE_WITH_PARENT=<pid>`` set (:func:`child_env`), on Linux: SIGTERM this
    process when that parent dies, and exit now if it already has (it died before this ran; the
    child was handed to another parent). Elsewhere, or without the variable, nothing. Install the
    SIGTERM handler first: the signal then ends the process the way the handler says."""
    wanted = os.environ.get(PARENT_ENV, "")
    if not wanted.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(wanted):
        raise SystemExit(f"the process that started this one ({wanted}) is gone")
