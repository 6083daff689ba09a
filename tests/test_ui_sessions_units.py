"""The web console's sessions and the query-string refusal, without a server (issue 44):
``agentserver/http/ui/sessions.py`` on its in-memory table and a hand-moved clock, the
session's proof bound to the client's token, and ``agentserver/http/query_tokens.py``'s
parser (hypothesis: a credential anywhere in a query is found, nothing else is)."""

from __future__ import annotations

from urllib.parse import urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentserver.agents.clock import ManualClock
from agentserver.core.handshake import Credential, Identity
from agentserver.http.auth import HttpAuth
from agentserver.http.query_tokens import CREDENTIAL_NAMES, token_in_query
from agentserver.http.ui.security import session_csrf
from agentserver.http.ui.sessions import MemorySessionTable, UiSessions, id_hash

TOKENS = {"alice": "alice-secret-token", "bob": "bob-secret-token"}


def auth(tokens: dict[str, str] = TOKENS) -> HttpAuth:
    allowed = {"bob": frozenset({"echo"})}
    return HttpAuth({n: Credential(t, allowed.get(n)) for n, t in tokens.items()})


def sessions(clock: ManualClock, lifetime: float = 3600.0, **kw) -> UiSessions:
    return UiSessions(MemorySessionTable(clock, **kw), auth(), lifetime)


async def test_a_session_is_the_clients_identity_until_it_expires():
    clock = ManualClock()
    ui = sessions(clock)
    alice = auth().identify("Bearer " + TOKENS["alice"], None)
    bob = auth().identify("Bearer " + TOKENS["bob"], None)
    a, b = await ui.create(alice), await ui.create(bob)
    assert a != b and len(a) >= 43
    # The same identity the bearer token gets (name and may-address).
    assert await ui.resolve(a) == alice == Identity("alice", None)
    assert await ui.resolve(b) == bob == Identity("bob", frozenset({"echo"}))
    # The table holds neither the id nor the token, only a hash and a proof.
    rows = ui.table.rows  # type: ignore[attr-defined]
    assert a not in rows and id_hash(a) in rows
    for client, proof, _ in rows.values():
        assert TOKENS[client] not in proof and a not in proof and b not in proof
    clock.advance(3599.0)
    assert await ui.resolve(a) == alice
    clock.advance(1.0)  # expired exactly at its lifetime
    assert await ui.resolve(a) is None and await ui.resolve(b) is None


async def test_signing_out_revokes_and_unknown_ids_are_nobody():
    ui = sessions(ManualClock())
    alice = Identity("alice", None)
    a = await ui.create(alice)
    other = await ui.create(alice)
    assert await ui.revoke(a) is True
    assert await ui.resolve(a) is None
    assert await ui.revoke(a) is False  # a second sign-out: nothing left
    assert await ui.resolve(other) == alice  # the client's other session stays
    for bogus in ("", "x", a[:-1] + ("A" if a[-1] != "A" else "B"), "../" * 20, "é" * 43):
        assert await ui.resolve(bogus) is None
    with pytest.raises(ValueError):
        await ui.create(Identity(None))


async def test_a_changed_token_or_a_removed_client_ends_its_sessions():
    clock = ManualClock()
    table = MemorySessionTable(clock)
    before = UiSessions(table, auth())
    a = await before.create(Identity("alice", None))
    b = await before.create(Identity("bob", frozenset({"echo"})))
    # The same table, the server restarted with alice's token changed and bob removed.
    after = UiSessions(table, auth({"alice": "a-new-token", "carol": "carol-token"}))
    assert await after.resolve(a) is None
    assert await after.resolve(b) is None
    again = UiSessions(table, auth())
    assert await again.resolve(a) == Identity("alice", None)


async def test_the_memory_table_is_bounded():
    clock = ManualClock()
    ui = sessions(clock, lifetime=10.0, max_sessions=3)
    alice = Identity("alice", None)
    first = [await ui.create(alice) for _ in range(3)]
    fourth = await ui.create(alice)  # the oldest goes
    assert await ui.resolve(first[0]) is None
    assert [await ui.resolve(s) for s in [*first[1:], fourth]] == [alice] * 3
    clock.advance(10.0)
    fresh = await ui.create(alice)  # the expired ones go first
    assert await ui.resolve(fresh) == alice
    assert len(ui.table.rows) == 1  # type: ignore[attr-defined]


def test_a_sessions_csrf_token_is_its_own_and_not_its_id():
    a, b = "a" * 43, "b" * 43
    assert session_csrf(a) == session_csrf(a) != session_csrf(b)
    assert a not in session_csrf(a)


# -- a token in a query string ------------------------------------------------------------

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-", min_size=1, max_size=12).filter(
    lambda n: n not in CREDENTIAL_NAMES
)
VALUES = st.text(max_size=30).filter(lambda v: v.strip() not in TOKENS.values())


@given(st.lists(st.tuples(NAMES, VALUES), max_size=6))
def test_a_query_without_credentials_passes(pairs):
    assert token_in_query(urlencode(pairs), auth()) is None


@given(
    st.lists(st.tuples(NAMES, VALUES), max_size=5),
    st.integers(min_value=0, max_value=5),
    st.sampled_from(sorted(CREDENTIAL_NAMES)),
    st.booleans(),
)
def test_a_credential_anywhere_in_a_query_is_found(pairs, at, name, upper):
    # By its parameter's name (any value, any case) ...
    named = list(pairs)
    named.insert(min(at, len(named)), (name.upper() if upper else name, "x"))
    assert token_in_query(urlencode(named), auth()) == name
    # ... or a declared token under any name, or as a name.
    valued = list(pairs)
    valued.insert(min(at, len(valued)), ("q", TOKENS["bob"]))
    assert token_in_query(urlencode(valued), auth()) == "a client's token"
    bare = urlencode(pairs) + "&" + TOKENS["alice"]
    assert token_in_query(bare, auth()) == "a client's token"


def test_query_parser_edges():
    a = auth()
    assert token_in_query("wait=false&thread=abc", a) is None
    assert token_in_query("next=%2Fui%2Fagents%2Fx%3Ftoken%3Dx", a) is None  # nested, no token
    assert token_in_query("access_token=", a) == "access_token"  # even empty
    assert token_in_query("x=" + "%20" + TOKENS["alice"] + "%20", a) == "a client's token"
    many = "&".join(f"p{i}=v" for i in range(2000))
    assert token_in_query(many + "&Token=x", a) == "token"  # however far in
    assert token_in_query(many + "&t=" + TOKENS["bob"], a) == "a client's token"
