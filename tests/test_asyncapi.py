"""The AsyncAPI document: generated from the code, committed, complete, and valid per the official CLI."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from shared.asyncapi import document, render, senders
from shared.schemas import Kind
from shared.topology import ROUTES, routable

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "asyncapi.yaml"
TOOLS = ROOT / ".tools" / "asyncapi"


def test_the_committed_document_is_what_the_code_generates() -> None:
    assert COMMITTED.read_text() == render(), (
        "docs/asyncapi.yaml is stale: run `make asyncapi` (or `fedfleet asyncapi --out docs/asyncapi.yaml`)"
    )


def test_every_kind_has_its_publishers_consumers_and_channels() -> None:
    doc = document()
    messages = doc["components"]["messages"]
    ops = doc["operations"].values()
    for kind in Kind:
        msg = messages[kind.value]
        assert msg["x-fedfleet-sender-roles"], kind
        assert msg["x-fedfleet-receivers"], kind
        sent = [
            o for o in ops if o["action"] == "send" and o["messages"][0]["$ref"].endswith(f"/{kind.value}")
        ]
        got = [
            o for o in ops if o["action"] == "receive" and o["messages"][0]["$ref"].endswith(f"/{kind.value}")
        ]
        assert sent and got, f"{kind.value}: no send or no receive operation"
        for route in ROUTES[kind]:
            assert any(ch["address"] == route for ch in doc["channels"].values()), (kind, route)
    # what the document says a receiver accepts is what the receivers check
    assert messages["partial"]["x-fedfleet-sender-roles"] == ["aggregator"]
    assert senders(Kind.UPDATE) == {"aggregator": senders(Kind.UPDATE)["aggregator"]}


def test_a_kind_published_on_a_key_the_topology_does_not_name_is_refused() -> None:
    """The services publish through ``_check_route``: the document cannot promise one key while the
    code uses another."""
    from services.common import _check_route

    assert routable(Kind.TASK, "host.c-1") and routable(Kind.DECISION, "agg.agg-0-1a2b")
    assert not routable(Kind.TASK, "update") and not routable(Kind.UPDATE, "server")
    with pytest.raises(ValueError, match="routing key"):
        _check_route(Kind.PARTIAL, "aggregators")


def test_the_document_passes_the_official_validator() -> None:
    cli = TOOLS / "node_modules" / ".bin" / "asyncapi"
    if not cli.exists():
        pytest.fail(f"{cli} is missing: `make setup` installs it (scripts/setup_asyncapi.sh)")
    env = {
        **os.environ,
        "ASYNCAPI_METRICS_CONFIG_PATH": str(TOOLS / "analytics.json"),
        "SUPPRESS_NO_CONFIG_WARNING": "1",
    }
    out = subprocess.run(
        [str(cli), "validate", str(COMMITTED)], capture_output=True, text=True, env=env, timeout=300
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "is valid" in text, text[-3000:]
    assert "(0 errors" in text, text[-3000:]


def test_the_document_is_plain_yaml_with_every_schema_it_references() -> None:
    doc = yaml.safe_load(COMMITTED.read_text())
    schemas = doc["components"]["schemas"]
    for msg in doc["components"]["messages"].values():
        name = msg["payload"]["$ref"].rsplit("/", 1)[1]
        assert name in schemas, name
    assert "Envelope" in schemas and "x-fedfleet-kind-codes" in schemas["Envelope"]
