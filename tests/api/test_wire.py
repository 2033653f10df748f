"""The contract's HTTP form (`registry.api.wire`): each `@http` method's remote call and server
endpoint are derived from its signature, so they cannot disagree. These check the derivation;
the server tests run every derived route end to end."""

from __future__ import annotations

import inspect

import pytest

from registry.api.contract import Registry
from registry.api.wire import Route, http, route_of, routes
from registry.core.refs import CheckpointRef
from registry.errors import UsageError

# Written by hand on both sides, each for a reason its module docstring gives.
BY_HAND = {
    "user",
    "policy",
    "close",
    "push_checkpoint",
    "push_checkpoint_part",
    "commit_claimed",
    "pull",
    "pull_release",
    "fetch_release",  # no route: registry/api/consumers runs it on the client, over show and pull
    "validate",
    "promote",
    "heartbeat",
    "apply_policy",
}

SAMPLES = {
    "Text": "team-a",
    "Ref": "team-a/run@step3",
    "Flag": True,
    "Whole": 7,
    "Number": 2.5,
    "Version": "v3",
}


def _by_method() -> dict[str, Route]:
    return {r.method: r for r in routes(Registry)}


def test_every_method_of_the_contract_declares_its_route_or_is_written_by_hand():
    contract = {
        name
        for name, member in vars(Registry).items()
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    }
    declared = set(_by_method())
    assert declared and not declared & BY_HAND
    assert contract - declared == BY_HAND


def test_the_server_registers_each_declared_route_once():
    from registry.server.contract_routes import router

    served = {(r.path, m) for r in router.routes for m in r.methods}  # type: ignore[attr-defined]
    declared = {(r.path, r.verb) for r in routes(Registry)}
    assert served == declared
    # two methods share a path only when a fixed field tells them apart
    for path, verb in declared:
        shared = [r for r in routes(Registry) if (r.path, r.verb) == (path, verb)]
        if len(shared) > 1:
            assert all(r.fixed for r in shared)
            assert len({tuple(sorted(r.fixed.items())) for r in shared}) == len(shared)


@pytest.mark.parametrize("route", routes(Registry), ids=lambda r: r.method)
def test_what_the_client_sends_is_what_the_server_reads(route: Route):
    given = {f.arg: SAMPLES[type(f.kind).__name__] for f in route.fields}
    path, sent = route.request(given)
    assert "{" not in path
    for key, value in route.fixed.items():
        assert sent[key] == value
    doc = dict(sent)
    for name in route.in_path:
        doc[name] = path.rsplit("/", 1)[-1]
    if route.query:  # a query string carries text only
        doc = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in doc.items()}
    assert route.matches(doc)
    assert route.arguments(doc, from_query=route.query) == given


def test_a_parsed_ref_travels_as_its_string():
    route = _by_method()["show"]
    assert route.request({"ref": CheckpointRef("p", "r", 3)}) == ("/show", {"ref": "p/r@step3"})


def test_a_path_argument_is_quoted_whole():
    route = _by_method()["revoke_token"]
    assert route.request({"token_id": "a/../b"}) == ("/tokens/a%2F..%2Fb", {})


@pytest.mark.parametrize(
    ("method", "doc", "message"),
    [
        ("gc", {"dry_run": "yes"}, "dry_run must be true or false"),
        ("fsck", {"sample": 1.5}, "sample must be a whole number"),
        ("fsck", {"sample": True}, "sample must be a whole number"),
        ("scrub", {"rate": "fast"}, "rate must be a number"),
        ("scrub", {"rate": True}, "rate must be a number"),
        ("scrub", {"rate": 10**400}, "rate is out of range"),
        ("set_alias", {"model": "m", "alias": "prod", "version": False}, "version must be vK"),
        ("set_alias", {"model": "m", "alias": "prod"}, "version is required"),
        ("show", {"ref": ["a"]}, "ref must be a string"),
        ("create_token", {"principal": None}, "principal must be a string"),
    ],
)
def test_a_wrong_type_is_one_line_naming_the_field(method: str, doc: dict, message: str):
    with pytest.raises(UsageError, match=message):
        _by_method()[method].arguments(doc, from_query=False)


@pytest.mark.parametrize(
    ("method", "doc", "message"),
    [
        ("advise", {"run": "r", "gpus": "abc"}, "gpus must be a whole number"),
        ("advise", {"run": "r", "fleet": "maybe"}, "fleet must be true or false"),
        ("audit_log", {"since": "yesterday"}, "since must be a number"),
    ],
)
def test_a_query_value_is_read_by_its_kind(method: str, doc: dict, message: str):
    route = _by_method()[method]
    with pytest.raises(UsageError, match=message):
        route.arguments(doc, from_query=True)
    fine = route.arguments({"run": "r", "gpus": "8", "fleet": "true"}, from_query=True)
    assert fine.get("gpus", 8) == 8 and fine.get("fleet", True) is True


def test_an_omitted_optional_argument_takes_the_contracts_default():
    assert _by_method()["fsck"].arguments({}, from_query=False) == {}
    assert _by_method()["scrub"].arguments({"rate": None}, from_query=False) == {"rate": None}


def test_a_tuple_result_travels_as_an_object():
    route = _by_method()["export_policy"]
    answer = route.answer(({"Statement": []}, ["bob"]))
    assert answer == {"document": {"Statement": []}, "missing": ["bob"]}
    assert route.result(answer) == ({"Statement": []}, ["bob"])


def test_a_method_whose_argument_has_no_wire_kind_is_refused():
    class Contract:
        @http("POST", "/x")
        def send(self, data: bytes) -> None: ...

        @http("POST", "/y")
        def figures(self, **figures: float) -> None: ...

    with pytest.raises(TypeError, match="no wire kind"):
        route_of(Contract.send)
    with pytest.raises(TypeError, match="by hand"):
        route_of(Contract.figures)


def test_a_caller_side_argument_never_travels():
    for route in routes(Registry):
        assert not {"progress", "notes", "self"} & {f.arg for f in route.fields}, route.method


def test_a_misspelt_body_field_is_refused_not_ignored():
    with pytest.raises(UsageError, match="dryrun: no such field"):
        _by_method()["gc"].arguments({"dryrun": True}, from_query=False)
    assert _by_method()["gc"].arguments({"dry_run": True}, from_query=False) == {"dry_run": True}


@pytest.mark.parametrize(
    ("text", "value"), [("on", True), ("T", True), ("off", False), ("n", False)]
)
def test_a_query_flag_takes_the_spellings_of_before(text: str, value: bool):
    assert _by_method()["advise"].arguments({"run": "r", "fleet": text}, from_query=True) == {
        "run": "r",
        "fleet": value,
    }


def test_a_whole_number_past_what_the_catalog_holds_is_refused():
    with pytest.raises(UsageError, match="skip is out of range"):
        _by_method()["mlflow_sync"].arguments({"skip": 2**63}, from_query=False)
    with pytest.raises(UsageError, match="gpus is out of range"):
        _by_method()["advise"].arguments({"run": "r", "gpus": str(2**64)}, from_query=True)


def test_a_version_in_a_query_is_a_number_only_in_ascii_digits():
    from registry.api.wire import Version

    assert Version().from_query("version", "12") == 12
    assert Version().from_query("version", "²") == "²"


def test_pin_is_the_default_of_its_path_when_pinned_is_left_out():
    from registry.server.contract_routes import _pick

    shared = [r for r in routes(Registry) if r.path == "/pin"]
    assert _pick(shared, {"ref": "r@step1"}).method == "pin"
    assert _pick(shared, {"ref": "r@step1", "pinned": False}).method == "unpin"
    with pytest.raises(UsageError, match="pinned must be true or false"):
        _pick(shared, {"ref": "r@step1", "pinned": 0})
    status = [r for r in routes(Registry) if r.path == "/status"]
    with pytest.raises(UsageError, match="status must be deprecated or yanked"):
        _pick(status, {"ref": "m:v1"})


def test_a_run_named_with_its_project_may_not_contradict_the_project_given():
    from registry.core.refs import split_run

    assert split_run("team-a/r", "team-a") == ("team-a", "r")
    assert split_run("r", "team-a") == ("team-a", "r")
    with pytest.raises(UsageError, match="names project team-b"):
        split_run("team-b/r", "team-a")
