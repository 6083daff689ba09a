"""The local backend on a real engine: llama-cpp-python running the packaged SmolLM2-135M
(the `local` extra, in `dev`), through the router, the pump and a real server.

Kept few and short (small ``max_tokens``): CPU is scarce. Without llama-cpp-python or the
packaged model these tests skip, except under CI (``CI=true``), where they fail: CI
installs the dev extra, so a missing engine there is a broken install, not a skip.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import trio
import trio.testing
from lxml import etree
from serverproc import ServerProcess, subprocess_env

from agentserver.core.payloads import PayloadType
from agentserver.core.xsd_gbnf import document_grammar, reply_grammar
from agentserver.listeners import calculator
from agentserver.llm import LLMError, Message, Request, Router, check_llm_section
from agentserver.llm.backends import LlamaCppBackend
from agentserver.llm.classify import ErrorKind
from agentserver.llm.config import Provider, parse_llm_section
from agentserver.llm.local_models import LocalModelError, resolve_model_path

BOOT_NS = "https://xml-pipeline.org/ns/boot/v1"
CALC = "urn:agentserver:calculator"
ASSISTANT = "urn:agentserver:assistant"
PACKAGED = "packaged:smollm2-135m"


def _engine_missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install -e '.[dev]')"
    try:
        resolve_model_path(PACKAGED)
    except LocalModelError as exc:
        return str(exc)
    return None


_MISSING = _engine_missing()
if _MISSING is not None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the real engine: {_MISSING}", pytrace=False)
    pytest.skip(_MISSING, allow_module_level=True)

pytestmark = pytest.mark.slow


def llm_section(extra: str = "", window: int = 2048, path: str = PACKAGED) -> etree._Element:
    text = (
        f'<llm xmlns="{BOOT_NS}"><backend name="local" provider="llama-cpp" '
        f'model-path="{path}" context-window="{window}" threads="2" {extra}>'
        '<model name="smol"/></backend></llm>'
    )
    return etree.fromstring(text.encode())


def local_router(**kw) -> Router:
    return Router(parse_llm_section(llm_section(**kw)), environ={})


def ask(text: str, **kw) -> Request:
    return Request([Message.user(text)], model="smol", temperature=0.0, **kw)


async def test_a_plain_answer_counts_tokens_with_the_models_tokenizer():
    async with local_router() as router:
        done = await router.complete(ask("Say hello.", max_tokens=8))
        stats = router.stats()
    assert done.content.strip()
    assert done.backend == "local" and done.finish_reason in ("stop", "length")
    assert not done.usage.estimated
    assert 1 <= done.usage.completion_tokens <= 8
    # The prompt as the chat template writes it, counted by the model's tokenizer: what
    # llama-cpp-python's own chat completion reports for the same message.
    import llama_cpp

    own = llama_cpp.Llama(str(resolve_model_path(PACKAGED)), n_ctx=512, verbose=False)
    try:
        usage = own.create_chat_completion(
            messages=[{"role": "user", "content": "Say hello."}], max_tokens=1, temperature=0
        )["usage"]
    finally:
        own.close()
    assert done.usage.prompt_tokens == usage["prompt_tokens"]
    assert stats.backends["local"].counters.prompt_tokens == done.usage.prompt_tokens
    assert stats.backends["local"].counters.completion_tokens == done.usage.completion_tokens


async def test_a_streamed_answer_arrives_in_pieces_that_make_the_completion():
    async with local_router() as router:
        pieces: list[str] = []
        async with router.stream(ask("Count from one to ten.", max_tokens=12)) as stream:
            async for item in stream:
                if isinstance(item, str):
                    pieces.append(item)
                else:
                    done = item
    assert len(pieces) >= 2
    assert "".join(pieces) == done.content
    assert done.usage.completion_tokens <= 12


async def test_a_constrained_tool_call_is_accepted_and_routed_by_the_pump(tmp_path):
    types = [PayloadType.from_model(m) for m in (calculator.Add, calculator.Multiply)]
    # The call itself required (document grammar), as the reply grammar's call part.
    grammar = document_grammar(types)
    assert reply_grammar(types).count("::=") >= grammar.count("::=")
    request = ask(
        "Use the calculator to add 2 and 3. Write the XML call.",
        max_tokens=60,
        grammar=grammar,
    )
    async with local_router() as router:
        done = await router.complete(request)
    element = etree.fromstring(done.content.encode())
    assert any(t.schema.validate(element) for t in types), done.content
    boot = tmp_path / "boot.xml"
    boot.write_text(
        f'<organism xmlns="{BOOT_NS}" name="t"><listeners>'
        '<listener name="calculator" handler="calculator"/></listeners></organism>'
    )
    from agentserver.testing import in_process

    async with in_process(boot, environ={}) as organism:
        reply = await organism.request(done.content.encode(), timeout=30)
    assert reply.from_id == "calculator"
    assert etree.QName(reply.payload).namespace == CALC
    assert etree.QName(reply.payload).localname in ("sum", "product", "error")


async def test_the_grammar_is_off_with_constrain_false():
    async with local_router(extra='constrain="false"') as router:
        backend = next(iter(router._runtimes.values())).backend
        assert isinstance(backend, LlamaCppBackend)
        assert backend.grammar_for(ask("x", grammar="root ::= [a]")) is None


async def test_a_cancelled_generation_stops_within_a_few_tokens():
    async with local_router() as router:
        backend = next(iter(router._runtimes.values())).backend
        assert isinstance(backend, LlamaCppBackend)
        request = ask("Write a very long story about a dragon.", max_tokens=1500)
        read = 0
        with trio.CancelScope() as scope:
            async with router.stream(request) as stream:
                async for item in stream:
                    assert isinstance(item, str)
                    read += 1
                    if read == 3:
                        scope.cancel()
        assert scope.cancelled_caught
        # The thread ends on its own: the model's slot comes back (bounded wait).
        with trio.fail_after(60):
            await backend.wait_idle()
        assert backend.finished == 1
        # Tokens sampled: the ones read, plus at most the one in flight when it was told.
        assert backend.sampled <= read + 3 < 1500
        # And the model serves the next caller.
        done = await router.complete(ask("Hi.", max_tokens=2))
        assert done.usage.completion_tokens <= 2


async def test_callers_queue_first_come_first_served_one_generation_at_a_time():
    async with local_router() as router:
        order: list[int] = []

        async def one(i: int) -> None:
            await router.complete(ask(f"Say {i}.", max_tokens=2))
            order.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
                await trio.testing.wait_all_tasks_blocked()  # queued in this order
        backend = next(iter(router._runtimes.values())).backend
    assert order == [0, 1, 2]
    assert backend.finished == 3 and backend.max_running == 1


async def test_a_prompt_over_the_context_window_is_a_classified_error():
    async with local_router(window=128) as router:
        with pytest.raises(LLMError) as caught:
            await router.complete(ask("word " * 400, max_tokens=4))
    assert caught.value.kind is ErrorKind.CONTEXT_OVERFLOW
    assert "context window of 128" in caught.value.provider_message


def test_a_missing_or_broken_model_is_a_configuration_error_at_check(tmp_path):
    missing = check_llm_section(llm_section(path=str(tmp_path / "nope.gguf")), environ={})
    assert not missing.ok and "no file at" in missing.errors[0][1]
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"not a model at all")
    report = check_llm_section(llm_section(path=str(not_gguf)), environ={})
    assert not report.ok and "not a GGUF file" in report.errors[0][1]
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(resolve_model_path(PACKAGED).read_bytes()[:4096])
    report = check_llm_section(llm_section(path=str(truncated)), environ={})
    assert not report.ok and "cannot load" in report.errors[0][1]
    assert "download it again" in report.errors[0][1]
    unknown = check_llm_section(llm_section(path="packaged:nope"), environ={})
    assert not unknown.ok and "packaged:smollm2-135m" in unknown.errors[0][1]
    good = check_llm_section(llm_section(), environ={})
    assert good.ok and good.config.backends[0].provider is Provider.LLAMA_CPP


async def test_a_model_that_cannot_load_stops_the_router_at_start(tmp_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(resolve_model_path(PACKAGED).read_bytes()[:4096])
    from agentserver.llm.config import LlmConfigError

    with pytest.raises(LlmConfigError, match=r"backend 'local'.*cannot load"):
        async with local_router(path=str(bad)):
            pass


E2E_BOOT = f"""<?xml version="1.0" encoding="UTF-8"?>
<organism xmlns="{BOOT_NS}" name="local-e2e">
  <listen host="127.0.0.1" port="0"/>
  <llm>
    <backend name="local" provider="llama-cpp" model-path="{PACKAGED}" context-window="2048"
             threads="2" timeout="300" temperature="0">
      <model name="smol"/>
    </backend>
  </llm>
  <store path="state/agents.sqlite3"/>
  <listeners>
    <listener name="calculator" handler="calculator"/>
    <listener name="assistant" handler="assistant" agent="true" peers="calculator" timeout="600">
      <agent model="smol" max-steps="3" max-tokens="48">
        <system-prompt>You are a calculator front end. Examples:
User: Add 5 and 7.
You: &lt;add xmlns="{CALC}"&gt;&lt;a&gt;5&lt;/a&gt;&lt;b&gt;7&lt;/b&gt;&lt;/add&gt;
User: What is 6 times 4?
You: &lt;multiply xmlns="{CALC}"&gt;&lt;a&gt;6&lt;/a&gt;&lt;b&gt;4&lt;/b&gt;&lt;/multiply&gt;</system-prompt>
      </agent>
    </listener>
  </listeners>
</organism>
"""


async def test_a_turn_end_to_end_through_the_pump_with_the_calculator(tmp_path):
    boot = tmp_path / "boot.xml"
    boot.write_text(E2E_BOOT)
    env = subprocess_env()
    env.pop("OPENAI_API_KEY", None)
    server = await trio.to_thread.run_sync(lambda: ServerProcess.start(boot, env=env, cwd=tmp_path))
    try:
        from agentserver.core.threads import new_thread_id
        from agentserver.listeners.assistant import Task
        from agentserver.net.client import open_client

        async with open_client(server.host, server.port) as client:
            thread = new_thread_id()
            await client.send(Task(text="Add 2 and 3."), to="assistant", thread=thread)
            with trio.fail_after(600):
                reply = await client.receive()
    finally:
        code = await trio.to_thread.run_sync(server.stop)
    assert code == 0, server.stderr
    assert reply.thread == thread and reply.from_id == "assistant"
    assert reply.payload.tag == f"{{{ASSISTANT}}}answer"
    # The model's call went through the pump to the calculator and back: the store's
    # cards hold the tool call and its result.
    import sqlite3

    db = sqlite3.connect(pathlib.Path(tmp_path, "state", "agents.sqlite3"))
    try:
        types = [r[0] for r in db.execute("SELECT card_type FROM cards ORDER BY rowid")]
    finally:
        db.close()
    assert "tool.call" in types and "tool.result" in types, types
    assert "sys.huh" not in types, types  # the grammar let no malformed call through


def test_sampling_then_checking_the_grammar_picks_what_grammar_first_picks():
    """The backend samples first and checks its token against the grammar, resampling over
    the whole vocabulary only when the grammar refuses it (agentserver/llm/backends/
    llama_sampling.py). Greedy, that is the best token the grammar allows, which is what
    llama-cpp-python's grammar-first ``generate`` picks: the same tokens, on prompts where
    the model would write both allowed and refused tokens unconstrained."""
    import llama_cpp

    from agentserver.llm.backends.llama_sampling import constrained_tokens

    types = [PayloadType.from_model(m) for m in (calculator.Add, calculator.Multiply)]
    grammars = [reply_grammar(types), document_grammar(types), 'root ::= "yes" | "no"']
    llama = llama_cpp.Llama(str(resolve_model_path(PACKAGED)), n_ctx=512, verbose=False)
    eos = llama.token_eos()
    prompts = ["What is 2+3? Use the calculator.", "Say something about the sea."]
    refused_by_grammar = 0
    try:
        for grammar in grammars:
            for prompt in prompts:
                tokens = llama.tokenize(prompt.encode(), add_bos=False)

                def first(it, n=24):
                    out = []
                    for t in it:
                        if t == eos or len(out) == n:
                            break
                        out.append(t)
                    return out

                plain = first(llama.generate(tokens, temp=0.0, reset=True))
                reference = first(
                    llama.generate(
                        tokens,
                        temp=0.0,
                        reset=True,
                        grammar=llama_cpp.LlamaGrammar.from_string(grammar, verbose=False),
                    )
                )
                ours = first(constrained_tokens(llama, tokens, grammar, 0.0))
                assert ours == reference, (grammar[:60], prompt)
                refused_by_grammar += plain != reference
    finally:
        llama.close()
    # The prompts do reach the resampling path (the model's own choice refused).
    assert refused_by_grammar >= 3
