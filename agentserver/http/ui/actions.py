"""The web console's actions (POST, each CSRF-checked by :class:`UiSession`): log in and
out, send a task or a payload, decide an approval, stop and cancel.

None is a second implementation: a task, a payload and an approval decision go through
the HTTP gateway as the caller (exactly as ``POST /v1/messages`` sends them, so an
``<approval-decision>`` is applied by the agent, first decision winning, and acknowledged
as for ``/approve`` and ``/deny`` and the client's ``decide_approval``); stop and cancel
are the socket's operator commands, carried out by the same operator object with the
same rule for who may. Each action answers with a redirect (303) back to a console page,
its outcome in ``notice``.

Bounded: a form is read up to the gateway's ``max-message-bytes``; a decision waits for
its acknowledgement at most ``<http wait-timeout>`` (the gateway's bound); a task or a
payload is not waited for. A browser that leaves mid-action cancels the request's task:
what the gateway or the operator already did stands (as for an API caller who hangs up).
"""

from __future__ import annotations

import logging
from urllib.parse import quote, urlencode

from lxml import etree
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from agentserver.core.envelope import build_envelope
from agentserver.core.errors import InputRefused
from agentserver.core.namespaces import CORE_NS
from agentserver.core.payloads import model_xml
from agentserver.core.threads import is_uuid4, new_thread_id
from agentserver.core.usage import TaskForm
from agentserver.core.xmlsafe import SafeParser
from agentserver.http.context import HttpContext
from agentserver.http.ui.data import ConsoleData
from agentserver.http.ui.security import SESSION_COOKIE, page_headers, safe_next
from agentserver.http.ui.session import UiSession
from agentserver.primitives.approval import NS as APPROVAL_NS
from agentserver.primitives.approval import ApprovalDecision

log = logging.getLogger("agentserver.http.ui")

ACK_TAG = f"{{{APPROVAL_NS}}}approval-ack"
#: Characters of a reason or a task's text the console accepts.
MAX_TEXT = 20_000


def back(target: str, notice: str) -> Response:
    """A 303 to ``target`` (a console path) telling ``notice``."""
    sep = "&" if "?" in target else "?"
    url = f"{target}{sep}{urlencode({'notice': notice[:300]})}"
    return RedirectResponse(url, 303, page_headers())


def task_element(form: TaskForm, text: str) -> etree._Element:
    """A payload of ``form``'s type whose one text field holds ``text`` (``form.field``
    is not None). Raises ValueError for characters XML cannot carry."""
    root = etree.Element(form.tag, nsmap={None: form.namespace})
    if form.field:
        etree.SubElement(root, f"{{{form.namespace}}}{form.field}").text = text
    else:
        root.text = text
    return root


class Actions:
    """The POST routes of the console of one app."""

    def __init__(self, ctx: HttpContext, session: UiSession, data: ConsoleData) -> None:
        self.ctx = ctx
        self.session = session
        self.data = data
        self._parser = SafeParser(ctx.gateway.max_bytes)

    async def login(self, request: Request) -> Response:
        """Exchange a client's token for a new session (the cookie holds its id only);
        a session this browser held before ends."""
        fields = await self.session.check_post(request)
        if isinstance(fields, Response):
            return fields
        target = safe_next(fields.get("next"))
        token = fields.get("token", "").strip()
        identity = await self.session.gate.identify(request, f"Bearer {token}")
        if isinstance(identity, Response):
            return RedirectResponse(
                f"/ui/login?failed=1&next={quote(target, safe='/')}", 303, page_headers()
            )
        response = RedirectResponse(target, 303, page_headers())
        if self.session.needs_login:
            await self._end_session(request)
            self.session.set_login(response, await self.session.sessions.create(identity))
            log.info("web console: %s signed in", identity.name)
        return response

    async def logout(self, request: Request) -> Response:
        """Revoke the browser's session (on every process: the old cookie no longer
        works anywhere) and clear its cookie."""
        fields = await self.session.check_post(request)
        if isinstance(fields, Response):
            return fields
        response = RedirectResponse("/ui/login", 303, page_headers())
        await self._end_session(request)
        self.session.clear_login(response)
        return response

    async def _end_session(self, request: Request) -> None:
        session = request.cookies.get(SESSION_COOKIE)
        if session and await self.session.sessions.revoke(session):
            log.info("web console: a session signed out")

    async def send(self, request: Request) -> Response:
        """A task (``text``, filling the one text field of ``to``'s own task type) or a
        payload (``xml``) to ``to``, not waited for: the browser goes to the page where
        the answer appears."""
        identity = await self.session.identify(request)
        if isinstance(identity, Response):
            return identity
        fields = await self.session.check_post(request)
        if isinstance(fields, Response):
            return fields
        to = fields.get("to", "").strip()
        target = safe_next(fields.get("next"))
        text, xml = fields.get("text", ""), fields.get("xml", "").strip()
        if not to:
            return back(target, "Choose where to send it.")
        if xml:
            body = xml.encode("utf-8")
        elif text.strip():
            # The listener's own task type, whatever the form said: typed text fills its
            # one text field; a type with more than that is sent as XML.
            form = self.data.task_form(to)
            if form is None or form.field is None:
                return back(target, f"A task for {to} is XML: write it as a payload.")
            try:
                body = etree.tostring(task_element(form, text[:MAX_TEXT]))
            except ValueError:  # control characters XML cannot carry
                return back(target, "The text has characters XML cannot carry.")
        else:
            return back(target, "Write a task or a payload first.")
        thread = new_thread_id()
        outcome = await self.ctx.gateway.send(identity, to, body, wait=False, thread=thread)
        if outcome.kind == "refused":
            assert outcome.refusal is not None
            return back(target, f"Refused: {outcome.refusal}")
        if to in self.data.agent_names(identity):
            return RedirectResponse(f"/ui/agents/{quote(to)}/tasks/{thread}", 303, page_headers())
        return RedirectResponse(f"/ui/threads/{thread}?to={quote(to)}", 303, page_headers())

    async def decide(self, request: Request) -> Response:
        """Approve (``grant=true``) or deny (with ``reason``) request ``{request}`` of
        agent ``agent``: an ``<approval-decision>`` sent to the agent as the caller."""
        identity = await self.session.identify(request)
        if isinstance(identity, Response):
            return identity
        fields = await self.session.check_post(request)
        if isinstance(fields, Response):
            return fields
        request_id = request.path_params["request"]
        target = safe_next(fields.get("next"))
        agent = fields.get("agent", "")
        if agent not in self.data.agent_names(identity):
            return back(target, "No such agent.")
        grant = fields.get("grant") == "true"
        decision = ApprovalDecision(
            request=request_id, grant=grant, reason=fields.get("reason", "")[:MAX_TEXT]
        )
        body = model_xml(decision)
        outcome = await self.ctx.gateway.send(identity, agent, body, wait=True)
        status = self._ack_status(outcome.reply) if outcome.kind == "reply" else None
        verb = "Approved" if grant else "Denied"
        notices = {
            "applied": f"{verb}: request {request_id}.",
            "duplicate": f"Request {request_id} was already decided (or timed out).",
            "unknown": f"No request {request_id}.",
            "not-yours": f"Only the request's approver may decide request {request_id}.",
        }
        notice = notices.get(status or "", f"The decision on {request_id} got no answer.")
        log.info("web console: %s of %s by %s: %s", verb, request_id, identity.name, status)
        return back(target, notice)

    def _ack_status(self, reply: bytes) -> str | None:
        try:
            root = self._parser.parse(reply)
        except InputRefused:
            return None
        if len(root) < 2 or root[1].tag != ACK_TAG:
            return None  # a refusal (<huh>, <SystemError>) rather than an ack
        return root[1].get("status")

    async def operate(self, request: Request) -> Response:
        """``stop`` (the agent's active task, or only the one on ``thread``) or ``cancel``
        (the task on ``thread``, queued or running): the socket's operator command."""
        identity = await self.session.identify(request)
        if isinstance(identity, Response):
            return identity
        fields = await self.session.check_post(request)
        if isinstance(fields, Response):
            return fields
        verb = request.path_params["verb"]
        name = request.path_params["name"]
        if verb not in ("stop", "cancel"):
            return back("/ui", "No such action.")
        target = safe_next(fields.get("next"))
        operator = self.ctx.operator
        if operator is None or not self.data.is_operator(identity):
            return back(target, f"Only an operator may {verb}.")
        if name not in self.data.agent_names(identity):
            return back(target, "No such agent.")
        thread = fields.get("thread", "").strip() or None
        if thread is not None and not is_uuid4(thread):
            return back(target, "A thread is a uuid4.")
        if verb == "cancel" and thread is None:
            return back(target, "Cancel needs the task's thread.")
        command = etree.Element(f"{{{CORE_NS}}}{verb}", nsmap={None: CORE_NS})
        command.set("agent", name)
        if thread is not None:
            command.set("thread", thread)
        sender = identity.name or "web-console"
        frame = etree.tostring(build_envelope(sender, None, new_thread_id(), command))
        answer = await operator.handle(frame, sender)
        count = None
        if answer is not None:
            try:
                root = self._parser.parse(answer)
                count = root[1].get("count") if len(root) > 1 else None
            except InputRefused:
                count = None
        if count is None:
            return back(target, f"{verb} was refused.")
        if count == "0":
            return back(target, f"{verb}: nothing to {verb} for {name}.")
        return back(target, f"{verb}: {count} task(s) of {name} ended.")
