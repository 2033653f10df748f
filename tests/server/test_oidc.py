"""OIDC bearer JWTs of `reg server` (registry/server/oidc.py), over real HTTP with real keys.

The tests are their own identity provider: RSA and EC keys made here, a JWKS written to a file
and served by a tiny HTTP server on 127.0.0.1. Every forged, stale or misdirected JWT is a 401
(exit 4) with one line saying what is wrong, logged with that reason by the server; a valid one
gets exactly the grants of its principal, and reg tokens keep working beside it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from tests.serverproc import ROOT, RegServer, free_port, server_env, team_policy

ISSUER = "https://idp.example.test/realms/ml"
AUDIENCE = "reg-server"


# -- the identity provider -----------------------------------------------------------------------


@dataclass
class Idp:
    """Signing keys, the JWKS that publishes some of them, and JWTs made with any of them."""

    keys: dict[str, Any] = field(default_factory=dict)  # kid -> private key

    def add_rsa(self, kid: str) -> None:
        self.keys[kid] = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def add_ec(self, kid: str) -> None:
        self.keys[kid] = ec.generate_private_key(ec.SECP256R1())

    def jwks(self, *kids: str) -> dict[str, Any]:
        out = []
        for kid in kids:
            key = self.keys[kid]
            algo = RSAAlgorithm if isinstance(key, rsa.RSAPrivateKey) else ECAlgorithm
            jwk = algo.to_jwk(key.public_key(), as_dict=True)
            out.append({**jwk, "kid": kid, "use": "sig"})
        # A shared secret in the set must never become a verification key.
        out.append({"kty": "oct", "kid": "shared", "k": _b64(b"s" * 32)})
        return {"keys": out}

    def token(
        self,
        sub: Any = "alice",
        *,
        kid: str | None = "rsa-1",
        signer: str | None = None,
        alg: str | None = None,
        omit: tuple[str, ...] = (),
        **claims: Any,
    ) -> str:
        now = int(time.time())
        payload = {
            "iss": ISSUER,
            "aud": AUDIENCE,
            "sub": sub,
            "iat": now,
            "exp": now + 300,
            "jti": uuid.uuid4().hex[:12],
            **claims,
        }
        for name in omit:
            payload.pop(name, None)
        key = self.keys[signer or kid or "rsa-1"]
        alg = alg or ("ES256" if isinstance(key, ec.EllipticCurvePrivateKey) else "RS256")
        headers = {"kid": kid} if kid is not None else {}
        return jwt.encode(payload, key, algorithm=alg, headers=headers)

    def public_pem(self, kid: str) -> bytes:
        return (
            self.keys[kid]
            .public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned(header: dict[str, Any], payload: dict[str, Any]) -> str:
    return f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(payload).encode())}"


def _claims(sub: str = "alice", **extra: Any) -> dict[str, Any]:
    now = int(time.time())
    return {"iss": ISSUER, "aud": AUDIENCE, "sub": sub, "iat": now, "exp": now + 300, **extra}


@pytest.fixture(scope="module")
def idp() -> Idp:
    out = Idp()
    out.add_rsa("rsa-1")
    out.add_ec("ec-1")
    out.add_rsa("rogue")  # never published
    return out


class JwksHttp:
    """The provider's jwks_uri: a real HTTP server on 127.0.0.1 that counts its fetches."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                body = json.dumps(outer.doc).encode()
                self.send_response(200 if self.path == "/jwks.json" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/jwks.json"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def jwks_http(idp: Idp):  # type: ignore[no-untyped-def]
    server = JwksHttp(idp.jwks("rsa-1", "ec-1"))
    yield server
    server.close()


def _oidc_server(home: Path, catalog_url: str, jwks: str, **extra: str) -> RegServer:
    env = server_env(home, catalog_url)
    env.update(REG_OIDC_ISSUER=ISSUER, REG_OIDC_AUDIENCE=AUDIENCE, REG_OIDC_JWKS=jwks, **extra)
    server = RegServer(env, home).init().start()
    server.apply_policy(team_policy())
    return server


@pytest.fixture(scope="module")
def jwks_file(idp: Idp, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("idp") / "jwks.json"
    path.write_text(json.dumps(idp.jwks("rsa-1", "ec-1")))
    return path


@pytest.fixture(scope="module")
def file_server(jwks_file: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One server (SQLite) for the attacks: JWKS from a file, the principal from `sub`."""
    home = tmp_path_factory.mktemp("oidc-file")
    server = _oidc_server(home, f"sqlite:///{home / 'catalog.db'}", str(jwks_file))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-rank DCP checkpoint (dcp.save in a single process): enough to push."""
    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    code = (
        "import sys, torch, warnings; warnings.simplefilter('ignore');"
        "import torch.distributed.checkpoint as dcp;"
        "dcp.save({'model': {'w': torch.arange(64.0).reshape(8, 8)}, 'step': 1},"
        " checkpoint_id=sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, capture_output=True)
    return out


def _whoami(server: RegServer, token: str) -> httpx.Response:
    return httpx.get(
        f"{server.url}/v1/whoami", headers={"authorization": f"Bearer {token}"}, timeout=30
    )


def _refused(server: RegServer, token: str) -> str:
    """The one-line message of a 401 for `token` (asserting it is one, with exit code 4)."""
    r = _whoami(server, token)
    assert r.status_code == 401, r.text
    body = r.json()
    assert body["type"] == "Unauthenticated" and body["exit_code"] == 4, body
    assert "\n" not in body["message"]
    return str(body["message"])


def _one_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reg: "), res.stderr
    return lines[0]


def _log_lines(server: RegServer) -> list[dict[str, Any]]:
    out = []
    for line in server.log_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


# -- a valid JWT: the principal's grants, audited as OIDC ----------------------------------------


@pytest.mark.parametrize(
    "catalog_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_a_jwt_gets_its_principals_grants_beside_tokens(
    cli, catalog_url, idp, jwks_http, tiny_ckpt, tmp_path, monkeypatch
):
    """JWKS over HTTP, principal from preferred_username: alice pushes and lists in team-a, is
    refused in team-b, is audited as alice with an oidc credential; tokens still work; `reg
    login` stores the JWT like a token."""
    server = _oidc_server(
        tmp_path / "srv", catalog_url, jwks_http.url, REG_OIDC_CLAIM="preferred_username"
    )
    monkeypatch.delenv("REG_CATALOG_URL")  # the client's environment names only the server
    try:
        jti = "run-7f3a"
        token = idp.token("ignored-sub", preferred_username="alice", jti=jti)
        alice = {"REG_URL": server.url, "REG_TOKEN": token}
        push = ["push-ckpt", tiny_ckpt, "--run", "r", "--step", "1", "--json"]
        res = cli(*push, "--project", "team-a", env=alice)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["ref"] == "team-a/r@step1"
        listed = cli("ls", "--project", "team-a", "--json", env=alice)
        assert [c["ref"] for c in json.loads(listed.stdout)] == ["team-a/r@step1"]

        res = cli(*push, "--project", "team-b", env=alice)
        assert res.returncode == 4 and "alice may not push" in _one_line(res)

        res = cli("whoami", env=alice)
        assert (res.stdout, res.stderr) == ("alice\n", f"reg: authenticated by OIDC (oidc:{jti})\n")
        who = json.loads(cli("whoami", "--json", env=alice).stdout)
        assert who["principal"] == "alice"
        assert (who["authenticated_by"], who["token"]) == ("oidc", f"oidc:{jti}")

        events = server.call("admin", "GET", "/v1/audit")
        mine = [e for e in events if e["actor"] == "alice"]
        assert {(e["action"], e["outcome"]) for e in mine} >= {
            ("push", "allowed"),
            ("push", "denied"),
        }
        assert {e["details"]["token"] for e in mine} == {f"oidc:{jti}"}
        # No jti: the credential is a short hash of the JWT itself.
        bare = idp.token("x", preferred_username="alice", omit=("jti",))
        hashed = f"oidc:sha256:{hashlib.sha256(bare.encode()).hexdigest()[:16]}"
        assert _whoami(server, bare).json()["token"] == hashed

        # A reg token works on the same server; bob's grant is team-b only.
        bob = {"REG_URL": server.url, "REG_TOKEN": server.token("bob")}
        assert cli("ls", "--project", "team-b", "--json", env=bob).returncode == 0
        res = cli(*push, "--project", "team-a", env=bob)
        assert res.returncode == 4 and "bob may not push" in _one_line(res)

        # `reg login` with a JWT, then commands with REG_URL alone.
        home = {"REG_HOME": str(tmp_path / "client-home")}
        res = subprocess.run(
            [sys.executable, "-m", "cli", "login", server.url, "--token-stdin", "--json"],
            cwd=ROOT,
            env={**_env(), **home},
            input=token + "\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["principal"] == "alice"
        who = cli("whoami", "--json", env={**home, "REG_URL": server.url})
        assert json.loads(who.stdout)["token"] == f"oidc:{jti}"

        # A flood of made-up kids costs the provider at most one fetch (then one a minute).
        before = jwks_http.hits
        for _ in range(25):
            forged = idp.token(kid=uuid.uuid4().hex, signer="rogue", preferred_username="alice")
            assert "is not in the JWKS" in _refused(server, forged)
        assert jwks_http.hits - before <= 1
    finally:
        server.stop()


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("REG_")}


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda idp: idp.token(kid="ec-1"), id="ES256"),
        pytest.param(lambda idp: idp.token(alg="PS256"), id="PS256-on-a-JWK-without-alg"),
        pytest.param(lambda idp: idp.token(aud=["other", AUDIENCE]), id="aud-list"),
        pytest.param(lambda idp: idp.token(exp=int(time.time()) - 10), id="exp-within-leeway"),
        pytest.param(lambda idp: idp.token(sub="alice@example.com"), id="email-name"),
    ],
)
def test_valid_jwts_are_accepted(file_server, idp, make):
    r = _whoami(file_server, make(idp))
    assert r.status_code == 200, r.text
    assert r.json()["authenticated_by"] == "oidc"
    assert r.json()["token"].startswith("oidc:")


# -- every attack is a 401 with one line ---------------------------------------------------------


def _none_alg(idp: Idp) -> str:
    return _unsigned({"alg": "none", "typ": "JWT", "kid": "rsa-1"}, _claims()) + "."


def _key_confusion(idp: Idp) -> str:
    """HS256 'signed' with the RSA public key's PEM bytes: what a naive verifier accepts."""
    signing_input = _unsigned({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}, _claims())
    mac = hmac.new(idp.public_pem("rsa-1"), signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(mac)}"


def _shared_secret(idp: Idp) -> str:
    """HS256 with the `oct` key the JWKS (wrongly) publishes."""
    signing_input = _unsigned({"alg": "HS256", "typ": "JWT", "kid": "shared"}, _claims())
    mac = hmac.new(b"s" * 32, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(mac)}"


def _tampered(idp: Idp) -> str:
    head, _, sig = idp.token("alice").split(".")
    return f"{head}.{_b64(json.dumps(_claims('admin')).encode())}.{sig}"


ATTACKS = [
    ("expired", lambda i: i.token(exp=int(time.time()) - 120), "the JWT has expired ("),
    ("not-yet-valid", lambda i: i.token(nbf=int(time.time()) + 600), "not valid yet (nbf "),
    ("issued-in-future", lambda i: i.token(iat=int(time.time()) + 600), "not valid yet (iat "),
    ("wrong-issuer", lambda i: i.token(iss="https://evil.test"), "issuer is not " + ISSUER),
    ("wrong-audience", lambda i: i.token(aud="other-app"), "audience is not " + AUDIENCE),
    ("no-audience", lambda i: i.token(omit=("aud",)), "has no 'aud' claim"),
    ("no-exp", lambda i: i.token(omit=("exp",)), "has no 'exp' claim"),
    ("bad-signature", lambda i: i.token(kid="rsa-1", signer="rogue"), "signature does not"),
    ("tampered-payload", _tampered, "signature does not verify"),
    ("alg-none", _none_alg, "algorithm 'none' is not accepted"),
    ("hs256-key-confusion", _key_confusion, "algorithm 'HS256' is not accepted"),
    ("hs256-oct-key", _shared_secret, "algorithm 'HS256' is not accepted"),
    ("alg-key-mismatch", lambda i: i.token(kid="ec-1", signer="rogue", alg="RS256"), "not fit"),
    ("unknown-kid", lambda i: i.token(kid="nope", signer="rogue"), "'nope' is not in the JWKS"),
    ("no-kid-two-keys", lambda i: i.token(kid=None), "names no key (no kid)"),
    ("missing-claim", lambda i: i.token(omit=("sub",)), "has no 'sub' claim"),
    ("dot-dot-name", lambda i: i.token("../admin"), "'../admin' is not a principal name"),
    ("reserved-name", lambda i: i.token("reg-server"), "'reg-server' is not a principal name"),
    ("empty-name", lambda i: i.token(""), "sub '' is not a principal name"),
    ("long-name", lambda i: i.token("a" * 300), "is not a principal name"),
    ("number-name", lambda i: i.token(12345), "the JWT's sub must be a string"),
    ("malformed", lambda i: "eyJhbGciOi.x.y", "the JWT is malformed"),
    ("not-json", lambda i: f"{_b64(b'[1]')}.{_b64(b'{}')}.AA", "the JWT is malformed"),
    ("oversized", lambda i: "a" * 9000 + ".b.c", "over 8192 characters"),
    ("neither-kind", lambda i: "x.y", "neither a reg token (reg_...) nor a JWT"),
]


@pytest.mark.parametrize(
    ("make", "expected"), [a[1:] for a in ATTACKS], ids=[a[0] for a in ATTACKS]
)
def test_each_attack_is_a_401_with_its_reason(file_server, idp, make, expected):
    assert expected in _refused(file_server, make(idp))


def test_refusals_exit_4_in_one_line_and_are_logged_with_the_reason(cli, file_server, idp):
    expired = idp.token(exp=int(time.time()) - 120)
    res = cli("ls", env={"REG_URL": file_server.url, "REG_TOKEN": expired})
    assert res.returncode == 4 and "the JWT has expired" in _one_line(res)
    res = cli("ls", env={"REG_URL": file_server.url, "REG_TOKEN": _key_confusion(idp)})
    assert res.returncode == 4 and "'HS256' is not accepted" in _one_line(res)
    deadline = time.monotonic() + 5  # the line is written just after the answer is sent
    while True:
        refused = [e for e in _log_lines(file_server) if e.get("status") == 401]
        reasons = [(e["token"], e["reason"]) for e in refused]
        if (reasons and "'HS256'" in reasons[-1][1]) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert reasons[-1][0] == "oidc" and "'HS256' is not accepted" in reasons[-1][1]
    assert any(t == "oidc" and "the JWT has expired" in r for t, r in reasons)
    assert not [e for e in _log_lines(file_server) if e.get("status") == 500]


def test_a_jwks_file_is_reread_when_it_changes(file_server, idp, jwks_file):
    """Rotation: a new key works at once; a withdrawn key stops working at once."""
    idp.add_rsa("rsa-2")
    new = idp.token(kid="rsa-2")
    assert "'rsa-2' is not in the JWKS" in _refused(file_server, new)
    original = jwks_file.read_text()
    try:
        tmp = jwks_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(idp.jwks("rsa-2", "ec-1")))
        tmp.replace(jwks_file)
        assert _whoami(file_server, new).status_code == 200
        assert "'rsa-1' is not in the JWKS" in _refused(file_server, idp.token(kid="rsa-1"))
    finally:
        jwks_file.write_text(original)
    assert _whoami(file_server, idp.token(kid="rsa-1")).status_code == 200


# -- the JWKS URL: down provider, refresh floor, rotation ----------------------------------------


def test_a_jwks_url_that_is_down_is_a_401_and_tokens_still_work(cli, idp, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/jwks.json"
    home = tmp_path / "srv"
    server = _oidc_server(home, f"sqlite:///{home / 'catalog.db'}", dead)
    try:
        message = _refused(server, idp.token())
        assert message.startswith("cannot check the JWT now: cannot fetch JWKS http://127.0.0.1")
        assert "ConnectError" in message
        res = cli("ls", env=server.client_env("vera"))
        assert res.returncode == 0, res.stderr
    finally:
        server.stop()


def test_the_url_cache_refetches_for_an_unknown_kid_at_most_once_a_minute(idp, jwks_http):
    from registry.server import jwks

    now = [1000.0]
    source = jwks.UrlJwks(jwks_http.url, clock=lambda: now[0])
    assert {k["kid"] for k in source.keys().keys} == {"rsa-1", "ec-1"}
    assert source.fetches == 1
    assert source.refreshed() is None  # within the floor: no fetch
    now[0] += jwks.REFRESH_FLOOR_S + 1
    jwks_http.doc = idp.jwks("rsa-1", "ec-1", "rogue")  # the provider rotates a key in
    try:
        fresh = source.refreshed()
        assert fresh is not None and fresh.matching("rogue") and source.fetches == 2
        assert source.refreshed() is None and source.fetches == 2
        # Renewed after MAX_AGE_S even with no unknown kid: withdrawn keys stop working.
        jwks_http.doc = idp.jwks("rsa-1")
        now[0] += jwks.MAX_AGE_S + 1
        assert not source.keys().matching("rogue") and source.fetches == 3
    finally:
        jwks_http.doc = idp.jwks("rsa-1", "ec-1")


def test_a_provider_outage_keeps_the_cached_keys(idp, jwks_http):
    from registry.server import jwks

    now = [0.0]
    source = jwks.UrlJwks(jwks_http.url, clock=lambda: now[0])
    assert source.keys().matching("rsa-1")
    source.url = f"http://127.0.0.1:{free_port()}/jwks.json"  # the provider goes away
    now[0] += jwks.MAX_AGE_S + 1
    assert source.keys().matching("rsa-1") and source.fetches == 2


def test_a_jwks_over_the_size_cap_or_not_a_jwks_is_refused(jwks_http):
    from registry.server import jwks

    with pytest.raises(jwks.JwksUnavailable, match="answered HTTP 404"):
        jwks.fetch_url(jwks_http.url.replace("jwks.json", "other"))
    jwks_http.doc = {"keys": [{"kty": "RSA", "n": "x" * jwks.MAX_JWKS_BYTES}]}
    try:
        with pytest.raises(jwks.JwksUnavailable, match="over 262144 bytes"):
            jwks.fetch_url(jwks_http.url)
    finally:
        jwks_http.doc = {"keys": []}
    with pytest.raises(jwks.JwksUnavailable, match="holds no public signing key"):
        jwks.parse_jwks(jwks.fetch_url(jwks_http.url), "test", 0.0)


def test_a_single_key_jwks_matches_a_jwt_without_kid(idp, tmp_path):
    from registry.server import oidc

    path = tmp_path / "one.json"
    doc = idp.jwks("rsa-1")
    doc["keys"] = [{k: v for k, v in doc["keys"][0].items() if k != "kid"}]
    path.write_text(json.dumps(doc))
    verifier = oidc.OidcVerifier(oidc.OidcConfig(ISSUER, AUDIENCE, str(path)))
    assert verifier.verify(idp.token(kid=None)).principal == "alice"
    with pytest.raises(oidc.Unauthenticated, match="'rsa-1' is not in the JWKS"):
        verifier.verify(idp.token(kid="rsa-1"))


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"REG_OIDC_ISSUER": ISSUER}, "REG_OIDC_AUDIENCE, REG_OIDC_JWKS missing"),
        ({"REG_OIDC_ISSUER": ISSUER, "REG_OIDC_AUDIENCE": "a"}, "REG_OIDC_JWKS missing"),
        ({"REG_OIDC_CLAIM": "email"}, "REG_OIDC_CLAIM set but OIDC is off"),
        ({"REG_OIDC_ALGORITHMS": "RS256,HS256"}, "HS256 is refused"),
        ({"REG_OIDC_ALGORITHMS": "none"}, "none is refused"),
        ({"REG_OIDC_ALGORITHMS": "RS257"}, "unknown algorithm 'RS257'"),
        ({"REG_OIDC_JWKS": "/nonexistent/jwks.json"}, "no such file"),
        ({"REG_OIDC_JWKS": "file:///etc/passwd"}, "only https://, http:// or a file path"),
        ({"REG_OIDC_JWKS": "http://idp.example.test/certs"}, "plain http lets anyone on the path"),
        ({"REG_OIDC_JWKS": "http://localhost.evil.test/j"}, "plain http lets anyone on the path"),
        ({"REG_OIDC_PRINCIPAL_PREFIX": "oidc:"}, "'oidc:' cannot start a principal name"),
        ({"REG_OIDC_REQUIRE": "repository_owner"}, "'repository_owner' is not claim=value"),
        ({"REG_OIDC_REQUIRE": "a=1,a=2"}, "names a twice with different values"),
        ({"REG_OIDC_PRINCIPAL_PREFIX": "oidc-"}, "REG_OIDC_PRINCIPAL_PREFIX set but OIDC is off"),
    ],
)
def test_a_partial_or_unsafe_oidc_setting_stops_the_server_in_one_line(
    tmp_path, jwks_file, settings, expected
):
    env = server_env(tmp_path / "srv", f"sqlite:///{tmp_path / 'catalog.db'}")
    if not {"REG_OIDC_ISSUER", "REG_OIDC_CLAIM"} & set(settings) and "off" not in expected:
        env.update(REG_OIDC_ISSUER=ISSUER, REG_OIDC_AUDIENCE=AUDIENCE, REG_OIDC_JWKS=str(jwks_file))
    env.update(settings)
    res = subprocess.run(
        [sys.executable, "-m", "cli", "server", "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert expected in _one_line(res)


def test_config_toml_holds_the_same_keys(tmp_path, jwks_file):
    from registry.core.config import Settings
    from registry.server.oidc_config import config_from

    (tmp_path / "config.toml").write_text(
        f'oidc_issuer = "{ISSUER}"\noidc_audience = "{AUDIENCE}"\n'
        f'oidc_jwks = "{jwks_file}"\noidc_claim = "email"\n'
        'oidc_algorithms = ["ES256", "EdDSA"]\noidc_principal_prefix = "corp-"\n'
        'oidc_require = ["repository_owner=my-org", "ref=refs/heads/main"]\n'
    )
    config = config_from(Settings.from_env({"REG_HOME": str(tmp_path)}))
    assert config is not None
    assert (config.issuer, config.claim, config.algorithms) == (ISSUER, "email", ("ES256", "EdDSA"))
    assert config.prefix == "corp-"
    assert config.require == (("repository_owner", "my-org"), ("ref", "refs/heads/main"))
    env = {"REG_HOME": str(tmp_path), "REG_OIDC_AUDIENCE": "other"}
    assert config_from(Settings.from_env(env)).audience == "other"  # type: ignore[union-attr]
    assert config_from(Settings.from_env({"REG_HOME": str(tmp_path / "none")})) is None


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_a_server_without_oidc_refuses_jwts_with_a_clear_line(cli, idp, reg_server):
    assert _refused(reg_server, idp.token()) == (
        "this server accepts no JWTs (OIDC is not configured)"
    )
    res = cli("ls", env={"REG_TOKEN": idp.token()})
    assert res.returncode == 4 and "accepts no JWTs" in _one_line(res)


def test_private_members_of_a_published_key_are_never_used(idp, tmp_path):
    """A provider that leaks its private JWK: only the public half is used (no crash, no 500)."""
    from registry.server import oidc

    leaked = RSAAlgorithm.to_jwk(idp.keys["rsa-1"], as_dict=True)
    assert "d" in leaked
    path = tmp_path / "leaky.json"
    path.write_text(json.dumps({"keys": [{**leaked, "kid": "rsa-1"}]}))
    verifier = oidc.OidcVerifier(oidc.OidcConfig(ISSUER, AUDIENCE, str(path)))
    assert verifier.verify(idp.token()).principal == "alice"
    (key,) = verifier.source.keys().keys
    assert not {"d", "p", "q", "dp", "dq", "qi"} & set(key)


def test_a_broken_rewrite_of_the_jwks_file_keeps_the_last_good_keys(idp, tmp_path):
    from registry.server import jwks

    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(idp.jwks("rsa-1")))
    source = jwks.FileJwks(path)
    assert source.keys().matching("rsa-1")
    path.write_text('{"keys": [')  # a writer that is not atomic, caught halfway
    assert source.keys().matching("rsa-1")
    path.write_text(json.dumps(idp.jwks("ec-1")))
    assert source.keys().matching("ec-1") and not source.keys().matching("rsa-1")
    path.write_text("{")
    with pytest.raises(jwks.JwksUnavailable, match="is not JSON"):
        jwks.FileJwks(path).keys()  # no good keys to fall back on


def test_a_weak_rsa_key_in_the_jwks_is_refused(tmp_path):
    from registry.server import oidc

    idp = Idp({"weak": rsa.generate_private_key(public_exponent=65537, key_size=1024)})
    path = tmp_path / "weak.json"
    path.write_text(json.dumps(idp.jwks("weak")))
    verifier = oidc.OidcVerifier(oidc.OidcConfig(ISSUER, AUDIENCE, str(path)))
    with pytest.warns(UserWarning, match="1024 bits"):  # PyJWT signs with it, and says so
        token = idp.token(kid="weak")
    with pytest.raises(oidc.Unauthenticated, match="the JWKS key is refused .*1024"):
        verifier.verify(token)


def test_a_plain_http_jwks_url_is_accepted_only_on_loopback(tmp_path):
    """A man in the middle of an http:// JWKS fetch picks the keys, so only loopback may use it."""
    from registry.core.config import Settings
    from registry.errors import UsageError
    from registry.server.oidc_config import config_from

    def config(url: str) -> object:
        env = {"REG_HOME": str(tmp_path), "REG_OIDC_ISSUER": ISSUER, "REG_OIDC_AUDIENCE": "a"}
        return config_from(Settings.from_env({**env, "REG_OIDC_JWKS": url}))

    for ok in (
        "http://127.0.0.1:8080/jwks.json",
        "http://127.9.9.9/jwks.json",
        "http://[::1]:8080/jwks.json",
        "http://localhost/jwks.json",
        "http://LOCALHOST:1/x",
        "https://idp.example.test/certs",
    ):
        assert config(ok) is not None, ok
    for bad in (
        "http://idp.example.test/certs",
        "http://localhost.evil.test/jwks.json",
        "http://127.0.0.1.evil.test/jwks.json",
        "http://localhost@evil.test/jwks.json",
        "http://10.0.0.1/jwks.json",
        "http://[::1/jwks.json",
    ):
        with pytest.raises(UsageError, match="plain http lets anyone on the path swap the keys"):
            config(bad)


# -- which claim names the principal: unverified email, prefix, required claims ------------------


@pytest.mark.process
@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_an_unverified_email_names_no_one(idp, jwks_file, catalog_url, tmp_path):
    """REG_OIDC_CLAIM=email: an address the user typed in (email_verified false or absent) is a
    401, however much it looks like a principal; a verified one is the principal."""
    server = _oidc_server(tmp_path / "srv", catalog_url, str(jwks_file), REG_OIDC_CLAIM="email")
    try:
        for verified, shown in [
            (False, "False"),
            ("false", "'false'"),
            (1, "1"),  # 1 == True in Python: must not pass
            ("True ", "'True '"),
            (None, "None"),
        ]:
            message = _refused(server, idp.token(email="admin", email_verified=verified))
            assert message == (
                f"the JWT's email is not verified (email_verified is {shown}); "
                "an unverified address names no one"
            )
        message = _refused(server, idp.token(email="admin"))
        assert "(email_verified is absent)" in message
        for verified in (True, "true"):
            r = _whoami(server, idp.token(email="alice@example.com", email_verified=verified))
            assert r.status_code == 200, r.text
            assert r.json()["principal"] == "alice@example.com"
        r = _whoami(server, idp.token(email="admin", email_verified=True))
        assert r.json()["principal"] == "admin"  # verified: the provider vouches for it
    finally:
        server.stop()


@pytest.mark.parametrize(
    "catalog_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_a_principal_prefix_and_required_claims(cli, idp, jwks_file, catalog_url, tmp_path):
    """A CI issuer's audience is anyone's to choose: REG_OIDC_REQUIRE pins the org and branch;
    REG_OIDC_PRINCIPAL_PREFIX keeps an OIDC `sub` of `admin` from being the token principal
    admin: it is oidc-admin, with only what the policy grants that name."""
    server = _oidc_server(
        tmp_path / "srv",
        catalog_url,
        str(jwks_file),
        REG_OIDC_PRINCIPAL_PREFIX="oidc-",
        REG_OIDC_REQUIRE="repository_owner=my-org, ref=refs/heads/main",
    )
    server.apply_policy(
        team_policy('\n[[access.grants]]\nprincipals = ["oidc-alice"]\nrole = "viewer"\n')
    )
    ours = {"repository_owner": "my-org", "ref": "refs/heads/main"}
    try:
        admin = idp.token("admin", **ours)
        r = _whoami(server, admin)
        assert r.status_code == 200 and r.json()["principal"] == "oidc-admin", r.text
        audit = httpx.get(
            f"{server.url}/v1/audit", headers={"authorization": f"Bearer {admin}"}, timeout=30
        )
        assert audit.status_code == 403, audit.text  # not admin's grants
        alice = {"REG_URL": server.url, "REG_TOKEN": idp.token("alice", **ours)}
        res = cli("ls", "--project", "team-a", "--json", env=alice)
        assert res.returncode == 0, res.stderr  # oidc-alice's own grant
        assert cli("ls", env=server.client_env("alice")).returncode == 0  # tokens unchanged

        cases: list[tuple[dict[str, Any], str]] = [
            ({**ours, "repository_owner": "evil-org"}, "repository_owner 'evil-org'"),
            ({**ours, "repository_owner": "My-Org"}, "repository_owner 'My-Org'"),
            ({**ours, "repository_owner": ["my-org"]}, "repository_owner ['my-org']"),
            ({"repository_owner": "my-org"}, "ref absent"),
            ({**ours, "ref": "refs/heads/main-evil"}, "ref 'refs/heads/main-evil'"),
        ]
        for claims, shown in cases:
            message = _refused(server, idp.token("alice", **claims))
            assert message == f"the JWT's {shown} is not the value REG_OIDC_REQUIRE needs"
        # The prefixed name must still be a principal name (at most 128 characters).
        message = _refused(server, idp.token("a" * 125, **ours))
        assert "is not a principal name with prefix 'oidc-'" in message
    finally:
        server.stop()
