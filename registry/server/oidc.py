"""OIDC bearer JWTs for `reg server` (DESIGN §9): the identity provider vouches for the name.

A JWT is accepted only when it is signed by a key of the configured JWKS, with an asymmetric
algorithm of the configured list, for the configured issuer and audience, and not expired; the
principal is REG_OIDC_PRINCIPAL_PREFIX plus one claim (`sub` by default) and must be a name
grants can hold. Reg tokens keep working beside it: `auth.py` tells the two apart by shape
(`reg_...` or three dotted parts).

Settings (env, or the same keys lowercased in `$REG_HOME/config.toml`): REG_OIDC_ISSUER,
REG_OIDC_AUDIENCE, REG_OIDC_JWKS (a file or an https URL), REG_OIDC_CLAIM, REG_OIDC_ALGORITHMS,
REG_OIDC_PRINCIPAL_PREFIX, REG_OIDC_REQUIRE (claim=value pairs that must all match: a CI issuer
lets anyone pick the audience, so `repository_owner=my-org` is what keeps other orgs out).
All three of issuer, audience and JWKS, or none: a partial setting would look like OIDC is on
while every JWT is refused, so `reg server` refuses to start instead.

Symmetric algorithms (HS*) and `none` can never be configured: the JWKS is public, so an HMAC
"signed" with its bytes proves nothing (the classic key-confusion forgery), and `none` proves
nothing at all. Only public members of a JWK are used; `oct` keys in a JWKS are ignored. A JWKS
URL must be https (else whoever is on the path picks the keys), except on a loopback host.

The claim must be one the user cannot edit: `sub` is stable and issuer-unique; `email` counts
only with `email_verified` true (otherwise anyone may type `admin` into their profile);
`preferred_username` is user-editable in some providers (Keycloak with self-service, Entra).

The settings are read and checked by registry/server/oidc_config.py; the JWKS itself (a file
or a URL, cached, refetched for an unknown kid at most once a minute) by registry/server/jwks.py.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.loader import PRINCIPAL
from registry.core.timeutil import iso
from registry.errors import Unauthenticated
from registry.operations.token_admin import SERVER_PRINCIPAL
from registry.server.jwks import FileJwks, JwksSource, JwksUnavailable, UrlJwks
from registry.server.oidc_config import OidcConfig, config_from

if TYPE_CHECKING:
    from registry.core.config import Settings

log = logging.getLogger("reg.server.oidc")

_EC_CURVES = {
    "ES256": "P-256",
    "ES256K": "secp256k1",
    "ES384": "P-384",
    "ES512": "P-521",
    "ES521": "P-521",
}

LEEWAY_S = 30.0  # clock skew allowed on exp, nbf and iat
MAX_JWT = 8192  # characters; real ID/access tokens are 1-2 KB
_JTI = re.compile(r"[A-Za-z0-9._-]{1,48}")
_ABSENT = object()  # a claim the JWT lacks (distinct from JSON null)

_HINT = "get a fresh token from your identity provider (REG_TOKEN, or reg login)"


@dataclass(frozen=True, slots=True)
class OidcIdentity:
    principal: str
    credential: str  # what the audit log and the request log name: oidc:<jti> or oidc:sha256:..


class OidcVerifier:
    def __init__(self, config: OidcConfig, source: JwksSource | None = None) -> None:
        self.config = config
        if source is None:
            source = (
                UrlJwks(config.jwks)
                if config.jwks_is_url
                else FileJwks(Path(config.jwks).expanduser())
            )
        self.source = source

    def verify(self, token: str) -> OidcIdentity:
        """The principal a JWT proves, or Unauthenticated with one line saying what is wrong."""
        import jwt

        if len(token) > MAX_JWT:
            raise _refused(f"the JWT is over {MAX_JWT} characters")
        try:
            header = jwt.get_unverified_header(token)
        except Exception as exc:  # PyJWTError, or anything a crafted header provokes
            raise _refused(f"the JWT is malformed ({_said(exc)})") from None
        alg, kid = header.get("alg"), header.get("kid")
        if not isinstance(alg, str) or alg not in self.config.algorithms:
            raise _refused(
                f"the JWT's algorithm {str(alg)[:16]!r} is not accepted here "
                f"(accepted: {', '.join(self.config.algorithms)})"
            )
        key = self._key(kid, alg)
        try:
            payload = jwt.decode(
                token,
                key=key,
                algorithms=[alg],
                audience=self.config.audience,
                issuer=self.config.issuer,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iss", "aud"], "enforce_minimum_key_length": True},
            )
        except jwt.PyJWTError as exc:
            raise _refused(self._why(exc, token)) from None
        except Exception:  # a JWT is attacker input: a library surprise is a refusal, not a 500
            log.exception("unexpected error while checking a JWT")
            raise _refused("the JWT could not be checked") from None
        return OidcIdentity(self._principal(payload), _credential(payload, token))

    def _key(self, kid: Any, alg: str) -> Any:
        try:
            keys = self.source.keys()
            found = keys.matching(kid)
            if not found and kid is not None:
                fresh = self.source.refreshed()
                if fresh is not None:
                    keys, found = fresh, fresh.matching(kid)
        except JwksUnavailable as exc:
            raise Unauthenticated(
                f"cannot check the JWT now: {exc}",
                "the server cannot read its identity provider's keys; retry, or use a reg token",
            ) from None
        if not found:
            if kid is None:
                raise _refused(f"the JWT names no key (no kid) and the JWKS has {len(keys.keys)}")
            raise _refused(f"the JWT's key {str(kid)[:64]!r} is not in the JWKS")
        fitting = [(i, k) for i, k in found if _fits(k, alg)]
        if not fitting:
            k = found[0][1]
            raise _refused(
                f"the JWT's algorithm {alg} does not fit key {str(kid)[:64]!r} "
                f"({k.get('kty')} {k.get('crv') or k.get('alg') or ''})".rstrip()
            )
        try:
            return keys.built(fitting[0][0], alg)
        except Exception as exc:  # a malformed JWK in the provider's set
            log.warning("JWKS key %r is unusable: %s", kid, exc)
            raise _refused(f"the JWKS key {str(kid)[:64]!r} is unusable") from None

    def _why(self, exc: Exception, token: str) -> str:
        import jwt
        from jwt.exceptions import InvalidJTIError, InvalidSubjectError

        if isinstance(exc, jwt.ExpiredSignatureError):
            return f"the JWT has expired{_at(token, 'exp')}"
        if isinstance(exc, jwt.ImmatureSignatureError):
            return f"the JWT is not valid yet{_at(token, 'iat' if '(iat)' in str(exc) else 'nbf')}"
        if isinstance(exc, jwt.MissingRequiredClaimError):
            return f"the JWT has no {exc.claim!r} claim"
        if isinstance(exc, jwt.InvalidIssuerError):
            return f"the JWT's issuer is not {self.config.issuer}"
        if isinstance(exc, jwt.InvalidAudienceError):
            return f"the JWT's audience is not {self.config.audience}"
        if isinstance(exc, jwt.InvalidSignatureError):
            return "the JWT's signature does not verify"
        if isinstance(exc, InvalidSubjectError | InvalidJTIError):
            claim = "sub" if isinstance(exc, InvalidSubjectError) else "jti"
            return f"the JWT's {claim} must be a string"
        if isinstance(exc, jwt.InvalidKeyError):
            return f"the JWKS key is refused ({_said(exc)})"
        return f"the JWT is not valid ({_said(exc)})"

    def _principal(self, payload: dict[str, Any]) -> str:
        for required, value in self.config.require:
            got = payload.get(required, _ABSENT)
            if not isinstance(got, str) or got != value:
                raise _refused(
                    f"the JWT's {required} {_shown(got)} is not the value REG_OIDC_REQUIRE needs"
                )
        claim = self.config.claim
        if claim not in payload:
            raise _refused(
                f"the JWT has no {claim!r} claim (REG_OIDC_CLAIM names the principal's claim)"
            )
        value = payload[claim]
        verified = payload.get("email_verified", _ABSENT)
        if claim == "email" and verified is not True and verified != "true":  # 1 == True: `is`
            raise _refused(
                f"the JWT's email is not verified (email_verified is {_shown(verified)}); "
                "an unverified address names no one"
            )
        name = self.config.prefix + value if isinstance(value, str) else value
        if not isinstance(name, str) or not PRINCIPAL.fullmatch(name) or name == SERVER_PRINCIPAL:
            raise _refused(
                f"the JWT's {claim} {_shown(value)} is not a principal name "
                f"{'with prefix ' + repr(self.config.prefix) + ' ' if self.config.prefix else ''}"
                f"(letters, digits, . _ @ -, at most 128, not {SERVER_PRINCIPAL})"
            )
        return name


def verifier_from(settings: Settings) -> OidcVerifier | None:
    config = config_from(settings)
    return None if config is None else OidcVerifier(config)


def looks_like_jwt(token: str) -> bool:
    """A compact JWS has three dot-separated parts; a reg token has no dot at all."""
    return token.count(".") == 2


def _fits(jwk: dict[str, Any], alg: str) -> bool:
    """May key `jwk` verify a signature made with `alg`? (A JWK's own alg, when given, binds.)"""
    if jwk.get("alg") not in (None, alg):
        return False
    kty, crv = jwk.get("kty"), jwk.get("crv")
    if alg.startswith(("RS", "PS")):
        return kty == "RSA"
    if alg in _EC_CURVES:
        return kty == "EC" and crv == _EC_CURVES[alg]
    return alg == "EdDSA" and kty == "OKP" and crv in ("Ed25519", "Ed448")


def _credential(payload: dict[str, Any], token: str) -> str:
    jti = payload.get("jti")
    if isinstance(jti, str) and _JTI.fullmatch(jti):
        return f"oidc:{jti}"
    return f"oidc:sha256:{hashlib.sha256(token.encode()).hexdigest()[:16]}"


def _at(token: str, claim: str) -> str:
    """` (exp 2026-01-01T00:00:00Z)` from the (already signature-checked) payload, if any."""
    import jwt

    try:
        payload = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return ""
    value = payload.get(claim)
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return f" ({claim} {iso(float(value))})"
        except (OverflowError, ValueError, OSError):
            return ""
    return ""


def _shown(value: Any) -> str:
    """A claim's value for a one-line message: repr, cut at 40 characters."""
    text = "absent" if value is _ABSENT else repr(value)
    return text[:40] + ("..." if len(text) > 40 else "")


def _said(exc: Exception) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__


def _refused(why: str) -> Unauthenticated:
    return Unauthenticated(why, _HINT)
