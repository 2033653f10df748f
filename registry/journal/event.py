"""One journal event (`"format": "reg.event/1"`), as written and as read back.

    {"format": "reg.event/1", "id": "<ns>-<uid>", "kind": "yank", "ts": 1764583449.12,
     "actor": "alice", "target": {"model": "tiny", "version": 2},
     "fact": {"reason": "bad eval"}, "key_id": "…" | null, "mac": "…" | null}

`id` is the object's own name (`journal/<day>/<id>.json`), so a signed event copied under
another key, to move it in time, no longer matches. Kinds, their target and their fact:

    pin, unpin          project, run, step        reason (pin)
    yank, deprecate     model, version            reason
    alias               model, version            alias, from (the version it left, or null);
                                                  a protected alias's move also request,
                                                  requested_by, approved_by (names)
    alias-request       model, version            alias, request (its id), expires_at, approvals
    alias-decision      model, version            alias, request, decision, reason
    policy              version                   text, sha256
    validation          project, run, step        the Validation row's columns, and its id
    aborted             event (another event's id)  error: its catalog commit failed

With the audit key, `mac` = HMAC-SHA256(key, "reg.journal.event/1\\n" + canonical JSON of the
event without `mac`), and `key_id` names the key. Reading is strict: at most MAX_BYTES, UTF-8,
one JSON object, no duplicate keys, no NaN or Infinity, every key known and of its shape; any
failure is one `InvalidDocument` line naming the object.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from registry.core.layout import journal_key, parse_journal_key
from registry.errors import InvalidDocument
from registry.formats.strict_json import StrictReader
from registry.trust.audit_chain.keys import key_id
from registry.trust.audit_chain.macs import canonical, same

FORMAT = "reg.event/1"
MAX_BYTES = 1024 * 1024


class JournalKind(StrEnum):
    """The decisions the journal holds (and `aborted`: a decision whose commit failed)."""

    PIN = "pin"
    UNPIN = "unpin"
    YANK = "yank"
    DEPRECATE = "deprecate"
    ALIAS = "alias"
    POLICY = "policy"
    VALIDATION = "validation"
    ABORTED = "aborted"
    ALIAS_REQUEST = "alias-request"
    ALIAS_DECISION = "alias-decision"


(
    PIN,
    UNPIN,
    YANK,
    DEPRECATE,
    ALIAS,
    POLICY,
    VALIDATION,
    ABORTED,
    ALIAS_REQUEST,
    ALIAS_DECISION,
) = JournalKind
KINDS = tuple(JournalKind)
_DOMAIN = b"reg.journal.event/1\n"
_ID = re.compile(r"[0-9]{20}-[0-9a-f]{32}")
_VALIDATION_FACT = (
    "validation_id passed device device_name torch_version world_size seconds phases checks "
    "attested model_path mode driver"
)


@dataclass(frozen=True, slots=True)
class Event:
    id: str  # "<ns>-<uid>": the object's name, sorting by time
    kind: str
    ts: float
    actor: str
    target: dict[str, Any]
    fact: dict[str, Any]
    key_id: str | None = None
    mac: str | None = field(default=None, compare=False)
    # what was read, less the mac: the MAC is checked over it as stored (the parsed fields
    # are normalized, 3 -> 3.0, and would no longer be the signed bytes)
    stored: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> str:
        ns, _, uid = self.id.partition("-")
        return journal_key(int(ns), uid)

    def body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "id": self.id,
            "kind": self.kind,
            "ts": self.ts,
            "actor": self.actor,
            "target": self.target,
            "fact": self.fact,
            "key_id": self.key_id,
        }

    def to_bytes(self) -> bytes:
        return canonical(self.body() | {"mac": self.mac})

    def describe(self) -> str:
        t = self.target
        if "model" in t:
            return f"{self.kind} {t['model']}:v{t['version']}"
        if "run" in t:
            return f"{self.kind} {t['project']}/{t['run']}@step{t['step']}"
        if "event" in t:
            return f"{self.kind} {t['event']}"
        return f"{self.kind} v{t['version']}"


def sign(body: dict[str, Any], key: bytes) -> str:
    return hmac.new(key, _DOMAIN + canonical(body), hashlib.sha256).hexdigest()


def signature_problem(event: Event, key: bytes | None) -> str | None:
    """Why the event must not be trusted under `key` (None: it may be). Without a key nothing
    can be checked: the registry then trusts its store, as it does for manifests."""
    if key is None:
        return None
    if event.mac is None:
        return "unsigned, and this registry has an audit key"
    if event.key_id != key_id(key):
        return f"signed with another key (key id {event.key_id}, this registry's {key_id(key)})"
    body = event.stored if event.stored is not None else event.body()
    if not same(event.mac, sign(body, key)):
        return "its signature does not match its content (forged or altered)"
    return None


# -- reading --------------------------------------------------------------------------------


class _Refused(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"the key {k!r} appears twice in one object")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a finite number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"{text} is not a finite number")
    return value


def parse(data: bytes, key: str) -> Event:
    """The event stored at `key`, or InvalidDocument saying what is wrong with it."""
    r = StrictReader(key)
    place = parse_journal_key(key)
    if place is None:
        raise InvalidDocument(
            f"{key}: not where a journal event is kept", "it was not written by reg"
        )
    if len(data) > MAX_BYTES:
        raise r.error("document", f"is {len(data)} bytes, over {MAX_BYTES}")
    try:
        doc = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_unique,
            parse_constant=_no_constant,
            parse_float=_finite,
        )
    except _Refused as exc:
        raise r.error("document", str(exc)) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidDocument(
            f"{key}: not JSON ({str(exc).splitlines()[0][:200]})", "the stored event is damaged"
        ) from None
    if not isinstance(doc, dict):
        raise r.error("document", "is not a JSON object")
    if doc.get("format") != FORMAT:
        raise r.error("format", f"is {doc.get('format')!r}; this reg reads {FORMAT}")
    r.keys(doc, "format id kind ts actor target fact key_id mac")
    ident = r.text(doc["id"], "id")
    if ident != f"{place[0]:020d}-{place[1]}":  # the name is signed: no moving it in time
        raise r.error("id", f"is {ident!r}, not the name it is stored under")
    kind = doc["kind"]
    if kind not in KINDS:
        raise r.error("kind", f"is {kind!r}; one of {', '.join(KINDS)}")
    key_id = r.optional(doc["key_id"], r.text, "key_id")
    mac = r.optional(doc["mac"], r.digest, "mac")
    if (key_id is None) != (mac is None):
        raise r.error("mac", "and key_id come together")
    return Event(
        id=ident,
        kind=kind,
        ts=r.number(doc["ts"], "ts"),
        actor=r.unicode(r.text(doc["actor"], "actor"), "actor"),
        target=_target(r, kind, doc["target"]),
        fact=_fact(r, kind, doc["fact"]),
        key_id=key_id,
        mac=mac,
        stored={k: v for k, v in doc.items() if k != "mac"},
    )


def _target(r: StrictReader, kind: str, value: Any) -> dict[str, Any]:
    if kind in (PIN, UNPIN, VALIDATION):
        t = r.mapping(value, "target", "project run step")
        return {
            "project": r.name(t["project"], "target.project"),
            "run": r.name(t["run"], "target.run"),
            "step": r.integer(t["step"], "target.step", minimum=0),
        }
    if kind in (YANK, DEPRECATE, ALIAS, ALIAS_REQUEST, ALIAS_DECISION):
        t = r.mapping(value, "target", "model version")
        return {
            "model": r.name(t["model"], "target.model"),
            "version": r.integer(t["version"], "target.version", minimum=1, maximum=10**9),
        }
    if kind == POLICY:
        t = r.mapping(value, "target", "version")
        return {"version": r.integer(t["version"], "target.version", minimum=1, maximum=2**31)}
    t = r.mapping(value, "target", "event")
    other = r.text(t["event"], "target.event")
    if not _ID.fullmatch(other):
        raise r.error("target.event", f"is {other!r}, not an event id")
    return {"event": other}


def _fact(r: StrictReader, kind: str, value: Any) -> dict[str, Any]:
    if kind in (PIN, YANK, DEPRECATE):
        f = r.mapping(value, "fact", "reason")
        reason = r.optional(f["reason"], lambda v, k: _string(r, v, k), "fact.reason")
        if kind == YANK and reason is None:
            raise r.error("fact.reason", "is missing: a yank has a reason")
        return {"reason": reason}
    if kind == UNPIN:
        return r.mapping(value, "fact", "")
    if kind == ALIAS:
        approved = isinstance(value, dict) and "approved_by" in value
        f = r.mapping(
            value, "fact", "alias from" + (" request requested_by approved_by" if approved else "")
        )
        out = {
            "alias": r.name(f["alias"], "fact.alias"),
            "from": r.optional(f["from"], lambda v, k: r.integer(v, k, minimum=1), "fact.from"),
        }
        if approved:
            names = f["approved_by"]
            if not isinstance(names, list) or len(names) > 100:
                raise r.error("fact.approved_by", "is not a list of names")
            out["request"] = r.integer(f["request"], "fact.request", minimum=1)
            out["requested_by"] = r.text(f["requested_by"], "fact.requested_by")
            out["approved_by"] = [r.text(n, "fact.approved_by") for n in names]
        return out
    if kind == ALIAS_REQUEST:
        f = r.mapping(value, "fact", "alias request expires_at approvals")
        return {
            "alias": r.name(f["alias"], "fact.alias"),
            "request": r.integer(f["request"], "fact.request", minimum=1),
            "expires_at": r.number(f["expires_at"], "fact.expires_at"),
            "approvals": r.integer(f["approvals"], "fact.approvals", minimum=1, maximum=1000),
        }
    if kind == ALIAS_DECISION:
        f = r.mapping(value, "fact", "alias request decision reason")
        decision = r.text(f["decision"], "fact.decision")
        if decision not in ("approved", "rejected", "cancelled"):
            raise r.error("fact.decision", f"is {decision!r}")
        return {
            "alias": r.name(f["alias"], "fact.alias"),
            "request": r.integer(f["request"], "fact.request", minimum=1),
            "decision": decision,
            "reason": r.optional(f["reason"], lambda v, k: _string(r, v, k), "fact.reason"),
        }
    if kind == POLICY:
        f = r.mapping(value, "fact", "text sha256")
        text = r.text(f["text"], "fact.text")
        digest = r.digest(f["sha256"], "fact.sha256")
        if hashlib.sha256(text.encode()).hexdigest() != digest:
            raise r.error("fact.sha256", "is not the sha256 of fact.text")
        return {"text": text, "sha256": digest}
    if kind == VALIDATION:
        return _validation(r, value)
    f = r.mapping(value, "fact", "error")
    return {"error": _string(r, f["error"], "fact.error")}


def _validation(r: StrictReader, value: Any) -> dict[str, Any]:
    f = r.mapping(value, "fact", _VALIDATION_FACT)
    phases = f["phases"]
    if not isinstance(phases, dict):
        raise r.error("fact.phases", "is not an object")
    checks = f["checks"]
    if not isinstance(checks, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("passed"), bool)
        for c in checks
    ):
        raise r.error("fact.checks", "is not a list of checks (each with name and passed)")
    return {
        "validation_id": r.integer(f["validation_id"], "fact.validation_id", minimum=1),
        "passed": r.boolean(f["passed"], "fact.passed"),
        "device": r.text(f["device"], "fact.device")[:16],
        "device_name": _string(r, f["device_name"], "fact.device_name"),
        "torch_version": _string(r, f["torch_version"], "fact.torch_version"),
        "world_size": r.integer(f["world_size"], "fact.world_size", minimum=1, maximum=2**31),
        "seconds": r.number(f["seconds"], "fact.seconds"),
        "phases": {
            r.unicode(k, "fact.phases"): r.number(v, f"fact.phases.{k}") for k, v in phases.items()
        },
        "checks": checks,
        "attested": r.boolean(f["attested"], "fact.attested"),
        "model_path": r.optional(f["model_path"], lambda v, k: _string(r, v, k), "fact.model_path"),
        "mode": r.optional(f["mode"], r.text, "fact.mode"),
        "driver": r.optional(f["driver"], lambda v, k: _string(r, v, k), "fact.driver"),
    }


def _string(r: StrictReader, value: Any, key: str) -> str:
    """Any string, the empty one included (a model at the top level has model_path "")."""
    if not isinstance(value, str):
        raise r.error(key, f"is {value!r}, not a string")
    return r.unicode(value, key)
