"""The console's interactive terminal, on prompt_toolkit: line editing, history kept in a
file, completion of ``@listener`` names and ``/commands``, a "working…" indicator while
a reply is awaited, and Ctrl-C / Ctrl-D to leave.

prompt_toolkit runs its own asyncio loop; the server runs on trio. Each prompt runs in a
worker thread (``trio.to_thread``), where prompt_toolkit starts and ends its loop for that
one line (it installs no signal handler outside the main thread). A cancelled read asks
the prompt to exit, so the terminal is always given back in its normal mode.

Piped input keeps :class:`agentserver.listeners.console.StdioTerminal`: see
:func:`make_terminal`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import trio

from agentserver.listeners.console import MAX_LINE_CHARS, StdioTerminal

if TYPE_CHECKING:
    from prompt_toolkit.completion import CompleteEvent
    from prompt_toolkit.document import Document
    from prompt_toolkit.input import Input
    from prompt_toolkit.output import Output

    from agentserver.agents.events import EventBus

log = logging.getLogger("agentserver.console")

COMMANDS = ("/help", "/listeners", "/describe", "/quit")
HISTORY_ENV = "AGENTSERVER_HISTORY"
WORKING = "working…"


def history_path(environ: os._Environ[str] | dict[str, str] | None = None) -> pathlib.Path | None:
    """Where the console keeps its history: ``$AGENTSERVER_HISTORY`` (empty: nowhere),
    else ``$XDG_STATE_HOME/agentserver/console_history`` (``~/.local/state`` by default)."""
    env = os.environ if environ is None else environ
    if HISTORY_ENV in env:
        value = env[HISTORY_ENV].strip()
        return pathlib.Path(value).expanduser() if value else None
    state = env.get("XDG_STATE_HOME") or str(pathlib.Path(env.get("HOME", "~"), ".local", "state"))
    return pathlib.Path(state).expanduser() / "agentserver" / "console_history"


def completions(text: str, names: Iterable[str]) -> list[tuple[str, int]]:
    """What completes ``text`` (the line before the cursor): ``(replacement, start)``
    pairs, ``start`` counted back from the cursor as prompt_toolkit wants it. Pure."""
    names = sorted(names)
    if text.startswith("/describe "):
        word = text[len("/describe ") :]
        if " " in word:
            return []
        bare = word.removeprefix("@")
        return [(name, -len(word)) for name in names if name.startswith(bare)]
    if " " in text:
        return []
    if text.startswith("@"):
        return [(f"@{name} ", -len(text)) for name in names if f"@{name}".startswith(text)]
    if text.startswith("/"):
        return [(command, -len(text)) for command in COMMANDS if command.startswith(text)]
    return []


class PromptTerminal:
    """A :class:`~agentserver.listeners.console.Terminal` on prompt_toolkit."""

    def __init__(
        self,
        *,
        history: pathlib.Path | None = None,
        input: Input | None = None,
        output: Output | None = None,
        listeners: Iterable[str] = (),
    ) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.completion import Completer, Completion
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        #: The listener names ``@`` and ``/describe`` complete (see :meth:`set_listeners`).
        self.names = tuple(sorted(listeners))
        terminal = self

        class _Completer(Completer):
            def get_completions(
                self, document: Document, complete_event: CompleteEvent
            ) -> Iterator[Completion]:
                for text, start in completions(document.text_before_cursor, terminal.names):
                    yield Completion(text, start_position=start)

        kept: FileHistory | InMemoryHistory = InMemoryHistory()
        if history is not None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True)
                history.touch(exist_ok=True)
                kept = FileHistory(str(history))
            except OSError as exc:
                log.warning("console history not kept: %s: %s", history, exc.strerror or exc)
        self._session: PromptSession[str] = PromptSession(
            history=kept, completer=_Completer(), input=input, output=output
        )
        self._working = False
        #: A reply is awaited (from working() until the next prompt).
        self.waiting = False
        self._streamed = False

    def set_listeners(self, names: Iterable[str]) -> None:
        """The listener names ``@`` and ``/describe`` complete, when they are learnt after
        the terminal is made (a remote console asks the server once connected)."""
        self.names = tuple(sorted(names))

    async def read_line(self, prompt: str) -> str | None:
        self._clear_working()
        self.waiting = False
        try:
            return await trio.to_thread.run_sync(self._read, prompt, abandon_on_cancel=True)
        except trio.Cancelled:
            self.interrupt()
            raise

    def _read(self, prompt: str) -> str | None:
        try:
            line = self._session.prompt(prompt)
        except (KeyboardInterrupt, EOFError):  # Ctrl-C, Ctrl-D: leave the console
            return None
        return line[:MAX_LINE_CHARS]

    def interrupt(self) -> None:
        """End a prompt in progress as if Ctrl-D was pressed (from any thread)."""
        app = self._session.app
        loop = getattr(app, "loop", None)
        if app.is_running and loop is not None:

            def leave() -> None:
                if app.is_running:
                    app.exit(exception=EOFError())

            loop.call_soon_threadsafe(leave)

    def write(self, text: str) -> None:
        self._clear_working()
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def working(self) -> None:
        """Show that a reply is awaited, until the next line is written or read."""
        self.waiting = True
        if not self._working:
            sys.stdout.write(WORKING)
            sys.stdout.flush()
            self._working = True

    def chunk(self, text: str) -> None:
        """A piece of a streamed answer, shown as it comes (replaces the indicator)."""
        if self._working:
            sys.stdout.write("\r\x1b[K")  # the text replaces the indicator
            self._working = False
        sys.stdout.write(text)
        sys.stdout.flush()
        self._streamed = True

    def _clear_working(self) -> None:
        if self._streamed:  # what follows starts on a line of its own
            sys.stdout.write("\n")
            self._streamed = False
        if self._working:
            sys.stdout.write("\r\x1b[K")  # back to the start of the line, erase it
            sys.stdout.flush()
            self._working = False


async def show_chunks(terminal: PromptTerminal, bus: EventBus) -> None:
    """Show the text agents stream (``ChunkEvent``) while the console awaits a reply.
    ``bus`` is the agents' :class:`~agentserver.agents.events.EventBus`; a slow terminal
    only loses chunks (the subscription is bounded), never the answer."""
    from agentserver.agents.events import ChunkEvent

    with contextlib.closing(bus.subscribe(capacity=256)) as subscription:
        async for event in subscription:
            if isinstance(event, ChunkEvent) and terminal.waiting and event.text:
                terminal.chunk(event.text)


def is_interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def make_terminal(listeners: Iterable[str] = ()) -> StdioTerminal | PromptTerminal:
    """prompt_toolkit for a person at a terminal, completing ``listeners``' names; plain
    lines for piped input."""
    if is_interactive():
        return PromptTerminal(history=history_path(), listeners=listeners)
    return StdioTerminal()


@contextlib.contextmanager
def logs_above_prompt(terminal: object) -> Iterator[None]:
    """While a :class:`PromptTerminal` runs, print whatever goes to standard output and
    error (server logs included) above the prompt line instead of through it."""
    if not isinstance(terminal, PromptTerminal):
        yield
        return
    from prompt_toolkit.patch_stdout import patch_stdout

    handlers = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and h.stream in (sys.stderr, sys.stdout)
    ]
    with patch_stdout(raw=True):
        previous = [h.setStream(sys.stderr) for h in handlers]
        try:
            yield
        finally:
            for handler, stream in zip(handlers, previous, strict=True):
                handler.setStream(stream)
