"""The release workflow behind `reg server`: identities from tokens, four eyes, an
approval forged into the catalog ignored, webhooks delivered by the server while a receiver
hangs, and only an admin sees subscribers (never their secrets)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx

from tests.server.test_server import _as, _one_line, _push
from tests.serverproc import team_policy
from tests.webhook_receiver import Receiver

WORKFLOW = """
[[access.grants]]
principals = ["rel2"]
role = "releaser"
projects = ["team-a"]
models = ["tiny-*"]

[[protected_aliases]]
alias = "prod*"
models = ["tiny-*"]
approvers = ["role:releaser"]
approvals = 1
expires = "1d"
"""


def _webhook(url: str, secret: Path) -> str:
    return (
        f'\n[[webhooks]]\nname = "deploy"\nurl = "{url}"\nevents = ["*"]\n'
        f'secret_file = "{secret}"\nallow_private = true\n'
    )


def _json(res):  # type: ignore[no-untyped-def]
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_protected_aliases_and_webhooks_through_the_server(
    cli, ckpts, reg_server, catalog_url, tmp_path: Path
):
    secret = tmp_path / "webhook.secret"
    secret.write_text(os.urandom(24).hex())
    secret.chmod(0o600)
    receiver = Receiver().start()
    try:
        reg_server.apply_policy(team_policy(WORKFLOW + _webhook(receiver.url, secret)))
        rel, rel2 = _as(reg_server, "rel"), _as(reg_server, "rel2")
        assert _push(cli, ckpts, 2, env=_as(reg_server, "alice")).returncode == 0
        validated = cli("validate", "team-a/r@step2", "--device", "cpu", env=_as(reg_server, "val"))
        assert validated.returncode == 0, validated.stderr
        made = _json(
            cli("promote", "team-a/r@step2", "--model", "tiny-a", "--alias", "prod", "--json",
                env=rel)
        )  # fmt: skip
        request = made["alias_request"]
        assert made["aliases"] == [] and request["state"] == "open" and "advisory" not in request
        res = cli("approve", str(request["request"]), env=rel)
        assert res.returncode == 4 and "four eyes" in _one_line(res)
        res = cli("approve", str(request["request"]), env=_as(reg_server, "vera"))
        assert res.returncode == 4 and "protected_aliases names role:releaser" in _one_line(res)
        res = cli("approve", str(request["request"]), "--version", "v2", env=rel2)
        assert res.returncode == 5 and "an approval names the exact version" in _one_line(res)
        done = _json(cli("approve", str(request["request"]), "--json", env=rel2))
        assert done["moved"] and done["approved_by"] == ["rel2"]
        shown = _json(cli("show", "tiny-a:v1", "--json", env=rel))
        assert shown["aliases"] == ["prod"]
        assert shown["alias_history"][0]["requested_by"] == "rel"

        # An approval written straight into the catalog (around the server) counts for nothing.
        eu = _json(cli("alias", "set", "tiny-a", "prod-eu", "v1", "--json", env=rel))
        _forge_approval(catalog_url, eu["request"], "mallory")
        listed = _json(cli("requests", "tiny-a", "--state", "open", "--json", env=rel2))
        assert [(r["request"], r["approved_by"]) for r in listed] == [(eu["request"], [])]
        res = cli("audit", "verify", "--json")
        kinds = [p["kind"] for p in json.loads(res.stdout)["problems"]]
        assert "alias_decision-unsigned" in kinds, kinds

        # Only an admin sees the subscribers, and never the secret.
        res = cli("webhook", "ls", env=rel)
        assert res.returncode == 4
        hooks = cli("webhook", "ls", "--json")
        assert json.loads(hooks.stdout)[0]["secret_ok"] is True
        assert secret.read_text() not in hooks.stdout

        # The server delivers on its own, and keeps answering while a receiver hangs.
        # Every event so far is answered before the receiver starts to hang: committed,
        # validation, promoted, requested, approved, moved and prod-eu's request.
        receiver.wait_for(7, timeout=30)
        _until_all_delivered(cli, time.monotonic() + 30)
        receiver.hang_s = 15.0
        assert cli("deprecate", "tiny-a:v1", "--reason", "old", env=rel).returncode == 0
        deadline = time.monotonic() + 5
        while not any(
            r["status"] == "pending" and r["attempts"] == 0
            for r in _json(cli("webhook", "deliveries", "--json"))
        ):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.0)  # the delivery is in flight: the receiver holds it
        headers = {"Authorization": f"Bearer {reg_server.token('admin')}"}
        for _ in range(5):
            started = time.monotonic()
            r = httpx.get(f"{reg_server.url}/v1/releases", headers=headers, timeout=10)
            assert r.status_code == 200 and time.monotonic() - started < 2.0
        receiver.hang_s = 0.0
        deadline = time.monotonic() + 40
        while not {"alias.rejected", "release.deprecated"} <= set(_answered(receiver)):
            assert time.monotonic() < deadline, receiver.events()
            time.sleep(0.3)
        # The server records a delivery once the receiver's answer is back: a moment after the
        # receiver counted it.
        deliveries = _until_all_delivered(cli, deadline)
        hung = [d["event"] for d in deliveries if d["attempts"] > 1]
        assert hung and set(hung) <= {"alias.rejected", "release.deprecated"}, deliveries

        # Rows written around the server are never signed with the subscriber's secret.
        forged_id = _forge_webhook_rows(catalog_url)
        deadline = time.monotonic() + 20
        while True:
            shown = {d["id"]: d for d in _json(cli("webhook", "deliveries", "--json"))}
            if shown.get(forged_id, {}).get("status") == "given-up":
                break
            assert time.monotonic() < deadline, shown.get(forged_id)
            time.sleep(0.3)
        assert "not the server's" in shown[forged_id]["last_error"]
        time.sleep(2.5)  # the forged outbox event had as long as the real ones took
        assert not [r for r in receiver.received if "forged" in r.body]
        assert "unsigned or its MAC does not verify" in reg_server.log_text()
    finally:
        receiver.stop()


def _until_all_delivered(cli, deadline: float) -> list[dict]:  # type: ignore[no-untyped-def]
    """The deliveries, once the server has recorded every one as delivered."""
    deliveries = _json(cli("webhook", "deliveries", "--json"))
    while {d["status"] for d in deliveries} != {"delivered"}:
        assert time.monotonic() < deadline, deliveries
        time.sleep(0.3)
        deliveries = _json(cli("webhook", "deliveries", "--json"))
    return deliveries


def _answered(receiver: Receiver) -> list[str]:
    """Events of the deliveries the receiver answered without hanging."""
    return [r.doc["event"] for r in receiver.received if not r.hung]


def _forge_approval(catalog_url: str, request: int, by: str) -> None:
    from registry.catalog.engine import Catalog
    from registry.catalog.workflow_models import AliasDecision

    catalog = Catalog(catalog_url)
    with catalog.session(write=True) as s:
        s.add(AliasDecision(request_id=request, decision="approved", by=by, at=time.time()))
    catalog.dispose()


def _forge_webhook_rows(catalog_url: str) -> int:
    """An outbox event and a delivery row inserted as any catalog writer could: the delivery's
    id."""
    from registry.catalog.engine import Catalog
    from registry.catalog.models import OutboxEvent
    from registry.catalog.workflow_models import WebhookDelivery

    catalog = Catalog(catalog_url)
    payload = {"model": "forged", "alias": "prod", "version": 9}
    with catalog.session(write=True) as s:
        s.add(OutboxEvent(ts=time.time(), kind="release.alias", payload=payload, uid="f" * 32))
        row = WebhookDelivery(
            subscriber="deploy",
            event_id="evt_forged",
            event="alias.moved",
            outbox_id=0,
            body='{"event":"alias.moved","id":"evt_forged","data":{"model":"forged"}}',
            created_at=time.time(),
            next_attempt_at=time.time(),
        )
        s.add(row)
        s.flush()
        forged = row.id or 0
    catalog.dispose()
    return forged
