"""The local backend: a GGUF model run in-process by llama-cpp-python (``provider="llama-cpp"``).

Generation runs in a worker thread so trio never blocks: the thread formats the prompt
with the model's chat template, tokenizes it, and samples token by token, posting each
piece of text to trio with ``run_sync_soon`` (non-blocking, in order) onto an unbounded
memory channel (``max_tokens`` bounds it). Before each token the thread reads a stop
flag, set when the stream is closed or its reader cancelled, so an abandoned generation
stops within a token.

One generation per model at a time (a llama.cpp context is not reentrant): callers queue
on a ``trio.Semaphore(1)``, which serves waiters first come, first served. The slot passes
to the thread, and the thread's end gives it back, so a reader that goes away early cannot
free the model while it still computes.

Token counts come from the model's own tokenizer (the prompt as templated, the tokens
sampled), so the router's buckets and the agents' budgets settle on exact figures.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..classify import ErrorKind
from ..config import BackendConfig
from ..local_models import LocalModelError, import_llama_cpp, load_model, resolve_model_path
from ..types import LLMError, Message, Reply, Request, Role, Usage

if TYPE_CHECKING:
    from llama_cpp.llama_types import ChatCompletionRequestMessage

__all__ = ["DEFAULT_N_CTX", "LlamaCppBackend", "LocalStream"]

#: The context window when the backend declares none.
DEFAULT_N_CTX = 4096
#: Sampling temperature when the request sets none (llama.cpp's own default).
DEFAULT_TEMPERATURE = 0.8
#: ChatML, for a GGUF without a chat template in its metadata.
_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _chat_message(message: Message) -> ChatCompletionRequestMessage:
    """A message as the chat template reads it (``{"role": ..., "content": ...}``)."""
    if message.role is Role.SYSTEM:
        return {"role": "system", "content": message.content}
    if message.role is Role.ASSISTANT:
        return {"role": "assistant", "content": message.content}
    return {"role": "user", "content": message.content}


@dataclass(slots=True)
class _Job:
    """One generation, shared by the trio side and its thread."""

    request: Request
    grammar: str | None
    post: Callable[[object], None]
    stop: threading.Event = field(default_factory=threading.Event)


class _Engine:
    """The loaded model and what the thread needs to drive it (thread side only)."""

    def __init__(self, llama: Any, n_ctx: int, temperature: float) -> None:
        import_llama_cpp()  # the clear error when the extra is missing
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.llama = llama
        self.n_ctx = n_ctx
        self.temperature = temperature
        # Imported here: numpy comes with llama-cpp-python (the local extra), not with us.
        from .llama_sampling import constrained_tokens

        self.constrained = constrained_tokens
        eos = llama.token_eos()
        bos = llama.token_bos()
        eos_text = llama.detokenize([eos], special=True).decode("utf-8", "replace")
        bos_text = llama.detokenize([bos], special=True).decode("utf-8", "replace")
        template = llama.metadata.get("tokenizer.chat_template") or _CHATML
        self.format = Jinja2ChatFormatter(template, eos_text, bos_text)
        self.stop_ids = {eos}
        # The template's end-of-turn marker, when it is one token (ChatML's <|im_end|>).
        for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
            if marker in template:
                ids = llama.tokenize(marker.encode(), add_bos=False, special=True)
                if len(ids) == 1:
                    self.stop_ids.add(ids[0])

    def prompt_tokens(self, request: Request) -> list[int]:
        prompt = self.format(messages=[_chat_message(m) for m in request.messages]).prompt
        return self.llama.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)

    def run(self, job: _Job, name: str, count: Callable[[], None]) -> None:
        """Generate ``job`` to its end, posting text pieces then one :class:`Reply` (or an
        :class:`LLMError`). Runs in the worker thread."""
        request = job.request
        tokens = self.prompt_tokens(request)
        room = self.n_ctx - len(tokens)
        if room < 1:
            job.post(
                LLMError(
                    ErrorKind.CONTEXT_OVERFLOW,
                    f"the prompt is {len(tokens)} tokens, over the model's context window of "
                    f"{self.n_ctx} (n_ctx); shorten the conversation or raise the backend's "
                    "context-window",
                    backend=name,
                )
            )
            return
        budget = min(request.max_tokens, room)
        temperature = self.temperature if request.temperature is None else request.temperature
        if job.grammar:
            sampled = self.constrained(self.llama, tokens, job.grammar, temperature)
        else:
            sampled = self.llama.generate(tokens, temp=temperature, reset=True)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = request.stop
        hold = max((len(s) for s in stops), default=1) - 1
        text = ""
        sent = 0  # characters of ``text`` already posted
        produced = 0
        finish = "length"
        for token in sampled:
            count()
            if job.stop.is_set():
                return  # abandoned: nobody reads any more
            if token in self.stop_ids:
                finish = "stop"
                break
            produced += 1
            text += decoder.decode(self.llama.detokenize([token]))
            cut = _first_stop(text, stops, max(0, sent - hold))
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            # Hold back what could be the start of a stop string.
            safe = len(text) - hold if stops else len(text)
            if safe > sent:
                job.post(text[sent:safe])
                sent = safe
            if produced >= budget:
                break
        if finish == "length":
            text += decoder.decode(b"", final=True)
        if len(text) > sent:
            job.post(text[sent:])
        job.post(Reply(text, request.model, Usage(len(tokens), produced), finish))


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    found = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(found) if found else None


class LocalStream:
    """An open local generation: text pieces, then the :class:`Reply`. :meth:`aclose` (or
    cancelling :meth:`next`) tells the thread to stop at its next token."""

    def __init__(self, job: _Job, receive: trio.MemoryReceiveChannel[object]) -> None:
        self._job = job
        self._receive = receive
        self._ended = False

    async def next(self) -> str | Reply:
        if self._ended:
            raise RuntimeError("stream already finished")
        try:
            item = await self._receive.receive()
        except trio.EndOfChannel:
            self._ended = True
            raise LLMError(
                ErrorKind.SERVER_ERROR, "the generation ended without an answer"
            ) from None
        except BaseException:
            self._job.stop.set()
            raise
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if isinstance(item, Reply):
            self._ended = True
        return item  # type: ignore[return-value]

    async def aclose(self) -> None:
        self._job.stop.set()
        self._receive.close()


class LlamaCppBackend:
    """One GGUF model served in-process (see the module doc). The model loads at the
    router's start (:meth:`start`), in a worker thread."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.name = config.name
        self.n_ctx = config.context_window or DEFAULT_N_CTX
        self._engine: _Engine | None = None
        self._slot = trio.Semaphore(1)
        #: Generations finished or abandoned-and-stopped (their thread ended).
        self.finished = 0
        #: Tokens sampled, over all generations (counted in the thread).
        self.sampled = 0
        #: Generations running now, and the most ever at once (1: one per model).
        self.running = 0
        self.max_running = 0
        #: The generation running now (at most one), told to stop when the router closes.
        self._current: _Job | None = None

    @property
    def path(self) -> Path:
        assert self.config.model_path is not None
        return resolve_model_path(self.config.model_path)

    async def start(self) -> None:
        """Load the model (blocking work in a thread). Raises :class:`LocalModelError`."""
        if self._engine is not None:
            return
        path = self.path
        n_ctx, threads = self.n_ctx, self.config.threads
        temperature = (
            DEFAULT_TEMPERATURE if self.config.temperature is None else self.config.temperature
        )

        def load() -> _Engine:
            return _Engine(load_model(path, n_ctx=n_ctx, threads=threads), n_ctx, temperature)

        self._engine = await trio.to_thread.run_sync(load)

    async def aclose(self) -> None:
        """Wait for the running generation (told to stop) and free the model."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if self._current is not None:
            self._current.stop.set()
        with trio.CancelScope(shield=True):
            await self._slot.acquire()
            try:
                await trio.to_thread.run_sync(engine.llama.close)
            finally:
                self._slot.release()

    async def wait_idle(self) -> None:
        """Return once no generation runs (callers queued before go first)."""
        async with self._slot:
            pass

    def grammar_for(self, request: Request) -> str | None:
        return request.grammar if self.config.constrain else None

    async def open_stream(self, request: Request, model: str, phase_timeout: float) -> LocalStream:
        """Queue for the model, then start generating; returns at once (the first piece
        comes through :meth:`LocalStream.next`)."""
        if self._engine is None:
            try:
                await self.start()
            except LocalModelError as exc:
                raise LLMError(ErrorKind.MODEL_NOT_FOUND, str(exc), backend=self.name) from None
        await self._slot.acquire()
        engine = self._engine
        if engine is None:  # closed while we queued
            self._slot.release()
            raise LLMError(ErrorKind.UNREACHABLE, "the local model is closed", backend=self.name)
        send, receive = trio.open_memory_channel[object](float("inf"))
        token = trio.lowlevel.current_trio_token()

        def deliver(item: object) -> None:  # on the trio thread
            try:
                send.send_nowait(item)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the reader went away

        def post(item: object) -> None:  # on the worker thread
            try:
                token.run_sync_soon(deliver, item)
            except trio.RunFinishedError:
                job.stop.set()

        job = _Job(request, self.grammar_for(request), post)

        def count() -> None:  # on the worker thread; one writer at a time (the slot)
            self.sampled += 1

        def work() -> None:
            try:
                engine.run(job, self.name, count)
            except LLMError as exc:
                post(exc)
            except Exception as exc:  # llama.cpp refused a decode, a bad grammar, ...
                post(LLMError(ErrorKind.SERVER_ERROR, f"llama.cpp: {exc!r}", backend=self.name))

        def ended(_outcome: object) -> None:  # on the worker thread, after work()
            def free() -> None:
                self.finished += 1
                self.running -= 1
                self._current = None
                self._slot.release()
                send.close()

            try:
                token.run_sync_soon(free)
            except trio.RunFinishedError:
                pass

        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self._current = job
        trio.lowlevel.start_thread_soon(work, ended, name=f"agentserver llama-cpp {self.name}")
        return LocalStream(job, receive)

    async def complete(self, request: Request, model: str, phase_timeout: float) -> Reply:
        stream = await self.open_stream(request, model, phase_timeout)
        try:
            while True:
                item = await stream.next()
                if isinstance(item, Reply):
                    return item
        finally:
            await stream.aclose()
