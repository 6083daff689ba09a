"""``<budget>``, ``<client weight>`` and ``<store fair-share>`` in boot.xml: read into
typed settings, and bad input refused with a clear problem by line."""

from __future__ import annotations

from agentserver.agents.policy.budget import BudgetSpec
from agentserver.config.loader import load_bytes
from agentserver.core.namespaces import BOOT_NS


def boot(organism: str = "", client: str = "", agent: str = "", store: str = "") -> bytes:
    return f"""<organism xmlns="{BOOT_NS}" name="b">
  {organism}
  <clients>
    <client name="alice" token-env="T_ALICE" weight="2">{client}</client>
    <client name="bob" token-env="T_BOB"/>
  </clients>
  <store path="state/a.sqlite3" {store}/>
  <listeners>
    <listener name="assistant" handler="assistant" agent="true">
      <agent model="m">{agent}</agent>
    </listener>
  </listeners>
</organism>""".encode()


ENV = {"T_ALICE": "a", "T_BOB": "b", "AGENTSERVER_MODEL": "m"}


def test_budgets_on_organism_agent_and_client_are_read():
    result = load_bytes(
        boot(
            organism='<budget cost="20" period="week" timezone="Europe/Paris"/>',
            client='<budget tokens="100"/><budget tokens="50" period="day" agent="assistant"/>',
            agent='<budget tokens="1000" soft="80%" period="total"/>',
            store='fair-share="true"',
        ),
        environ=ENV,
    )
    assert result.ok, result.problems
    topo = result.topology
    assert topo is not None
    assert set(topo.budgets) == {
        BudgetSpec("organism", cost=20.0, period="week", timezone="Europe/Paris", line=2),
        BudgetSpec("client:alice", tokens=100, line=4),
        BudgetSpec("client:alice@agent:assistant", tokens=50, period="day", line=4),
        BudgetSpec("agent:assistant", tokens=1000, soft=0.8, period="total", line=10),
    }
    assert topo.store.fair_weights == (("alice", 2.0), ("bob", 1.0))


def test_no_budget_and_fair_share_on_by_default():
    """Issue 43: fair share is on unless ``fair-share="false"``."""
    result = load_bytes(boot(), environ=ENV)
    assert result.ok and result.topology is not None
    assert result.topology.budgets == ()
    assert result.topology.store.fair_weights == (("alice", 2.0), ("bob", 1.0))
    for off in ("false", "0"):
        result = load_bytes(boot(store=f'fair-share="{off}"'), environ=ENV)
        assert result.ok and result.topology is not None
        assert result.topology.store.fair_weights is None, off


def test_bad_budgets_are_refused_by_line():
    cases = {
        '<budget period="day"/>': "limits tokens, cost or both",
        '<budget tokens="5" timezone="Mars/Base"/>': "unknown time zone",
        '<budget tokens="5" period="year"/>': "period",
        '<budget tokens="5" soft="80"/>': "soft",
        '<budget tokens="0"/>': "tokens",
    }
    for element, expect in cases.items():
        result = load_bytes(boot(organism=element), environ=ENV)
        assert not result.ok, element
        assert any(expect in p.message for p in result.problems), (element, result.problems)
    result = load_bytes(boot(client='<budget tokens="5" agent="nobody"/>'), environ=ENV)
    assert any("no agent of that name" in p.message for p in result.problems)
    result = load_bytes(boot(organism='<budget tokens="5" agent="assistant"/>'), environ=ENV)
    assert any("belongs on a client" in p.message for p in result.problems)
    twice = '<budget tokens="5"/><budget tokens="6"/>'
    result = load_bytes(boot(client=twice), environ=ENV)
    assert any("declared twice" in p.message for p in result.problems)
