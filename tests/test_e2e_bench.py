"""benchmarks/e2e.py's load generator: where its connections go."""

from __future__ import annotations

from collections import Counter

from benchmarks.e2e import Plan, connection_targets


def plan(client: int, spread: list[str], connections: int = 6) -> Plan:
    return Plan(
        "127.0.0.1:1",
        "m",
        [],
        [],
        1.0,
        connections=connections,
        spread=spread,
        client=client,
    )


def test_connections_go_to_the_shared_port_unless_spread() -> None:
    assert connection_targets(plan(3, [])) == ["127.0.0.1:1"] * 6


def test_spread_connections_share_the_gateways_evenly() -> None:
    gateways = [f"127.0.0.1:{2000 + i}" for i in range(8)]
    counts = Counter(
        target for c in range(5) for target in connection_targets(plan(c, gateways))
    )
    assert sorted(counts.values()) == [3, 3, 4, 4, 4, 4, 4, 4]  # 30 over 8
    assert connection_targets(plan(0, gateways, connections=1)) == gateways[:1]
