from agentserver.agents.edge.llm_adapter import RouterLLM
from agentserver.agents.errors import LLMUnavailable
from agentserver.agents.ports import LLMMessage, LLMRequest
from agentserver.llm.types import Completion, ErrorKind, LLMError, Usage


class FakeRouter:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen = None

    async def complete(self, request):
        self.seen = request
        if self.fail:
            raise LLMError(next(iter(ErrorKind)), "no backend")
        return Completion("hi", "m1", "b1", Usage(3, 4), "stop", 0.1, cost=None)


async def test_adapter_maps_request_and_completion():
    router = FakeRouter()
    out = await RouterLLM(router).complete(
        LLMRequest("a", "m", [LLMMessage("system", "s"), LLMMessage("user", "u")])
    )
    assert (out.content, out.model, out.backend, out.cost) == ("hi", "m1", "b1", 0.0)
    assert out.usage.total_tokens == 7
    assert router.seen.agent == "a" and router.seen.messages[1].content == "u"


async def test_adapter_turns_llm_error_into_unavailable():
    try:
        await RouterLLM(FakeRouter(fail=True)).complete(
            LLMRequest("a", "m", [LLMMessage("user", "u")])
        )
    except LLMUnavailable as exc:
        assert "no backend" in str(exc)
    else:
        raise AssertionError("expected LLMUnavailable")
