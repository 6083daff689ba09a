"""The ``agentserver`` command run by its entry point in the test's own process (helpers,
not tests): for the commands whose subprocess adds nothing (``check``, ``schemas``,
``--help``, usage errors). Each command family keeps one real-process smoke test
(tests/test_cli_commands.py); serverproc.py's ``cli`` runs a real process.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from dataclasses import dataclass
from unittest import mock

import structlog

from agentserver.cli.main import main


@dataclass(frozen=True)
class CliResult:
    """What a command left: its exit status and its standard output and error, as bytes
    (the fields of ``subprocess.CompletedProcess`` the tests read)."""

    returncode: int
    stdout: bytes
    stderr: bytes


def cli_in_process(*args: str, input: bytes = b"", env: dict[str, str] | None = None) -> CliResult:
    """``agentserver ARGS`` through :func:`agentserver.cli.main.main`, with ``env`` as the
    whole environment (else this process's) and ``input`` as standard input, for this call
    only. What the command configures for the process (logging: root handlers, level,
    structlog) is put back afterwards. Not for commands that serve or connect: those run
    in a process of their own (serverproc.py)."""
    out, err = io.StringIO(), io.StringIO()
    stdin = io.TextIOWrapper(io.BytesIO(input), encoding="utf-8")
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    structlog_config = structlog.get_config()
    environ = dict(os.environ) if env is None else env
    try:
        with (
            mock.patch.dict(os.environ, environ, clear=True),
            mock.patch.object(sys, "stdin", stdin),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                code = main(list(args))
            except SystemExit as exit_:  # argparse: --help (0) and usage errors (2)
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        structlog.configure(**structlog_config)
    return CliResult(code, out.getvalue().encode(), err.getvalue().encode())
