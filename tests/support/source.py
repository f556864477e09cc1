"""Parsing the repository's own source in the structural tests.

``ast.parse`` on CPython 3.11 keeps one recursion-depth counter for building AST objects per
interpreter; if a garbage collection during the build runs a finalizer that formats a traceback
(3.11's tracebacks ``ast.parse`` the failing line to place their carets -- an asyncio task left
pending by an earlier test logs one when collected), the nested parse leaves the counter off and
the outer one fails with ``SystemError: AST constructor recursion depth mismatch`` (CPython
gh-106905). A clean-clone run met it once. Collection is paused while parsing, so no finalizer
runs inside it."""

from __future__ import annotations

import ast
import gc


def parse_source(text: str) -> ast.Module:
    """``ast.parse(text)`` with no garbage collection (and so no finalizer) inside it."""
    was = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(text)
    finally:
        if was:
            gc.enable()
