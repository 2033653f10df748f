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

The JWKS itself (a file or a URL, cached, refetched for an unknown kid at most once a minute)
is read by registry/server/jwks.py.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import Unauthenticated, UsageError
from registry.server.jwks import FileJwks, JwksSource, JwksUnavailable, UrlJwks
from registry.text import redact_url

if TYPE_CHECKING:
    from registry.config import Settings

log = logging.getLogger("reg.server.oidc")

ASYMMETRIC = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
    "ES256", "ES256K", "ES384", "ES512", "ES521", "EdDSA",
)  # fmt: skip
DEFAULT_ALGORITHMS = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA",
)  # fmt: skip
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
_CLAIM = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")  # the start of a principal name
_LOOPBACK_NAMES = ("localhost",)
_ABSENT = object()  # a claim the JWT lacks (distinct from JSON null)

_HINT = "get a fresh token from your identity provider (REG_TOKEN, or reg login)"


# -- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OidcConfig:
    issuer: str
    audience: str
    jwks: str  # a file path or an http(s) URL
    claim: str = "sub"
    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    prefix: str = ""  # prepended to the claim's value: OIDC names apart from token names
    require: tuple[tuple[str, str], ...] = ()  # (claim, value): each must match exactly

    @property
    def jwks_is_url(self) -> bool:
        return self.jwks.startswith(("https://", "http://"))


def config_from(settings: Settings) -> OidcConfig | None:
    """The OIDC configuration of `settings`; None when it is off. A partial or unsafe one is a
    UsageError naming the setting, so the server refuses to start rather than refuse JWTs."""
    named = {
        "REG_OIDC_ISSUER": settings.oidc_issuer,
        "REG_OIDC_AUDIENCE": settings.oidc_audience,
        "REG_OIDC_JWKS": settings.oidc_jwks,
    }
    present = [k for k, v in named.items() if v]
    extras = [
        k
        for k, v in {
            "REG_OIDC_CLAIM": settings.oidc_claim,
            "REG_OIDC_ALGORITHMS": settings.oidc_algorithms,
            "REG_OIDC_PRINCIPAL_PREFIX": settings.oidc_principal_prefix,
            "REG_OIDC_REQUIRE": settings.oidc_require,
        }.items()
        if v
    ]
    if not present:
        if extras:
            raise UsageError(
                f"{', '.join(extras)} set but OIDC is off",
                "set REG_OIDC_ISSUER, REG_OIDC_AUDIENCE and REG_OIDC_JWKS too, or unset it",
            )
        return None
    if len(present) < len(named):
        missing = [k for k in named if k not in present]
        raise UsageError(
            f"OIDC is half configured: {', '.join(missing)} missing",
            "set REG_OIDC_ISSUER, REG_OIDC_AUDIENCE and REG_OIDC_JWKS together, or none of them",
        )
    issuer, audience, jwks = (str(v).strip() for v in named.values())
    claim = (settings.oidc_claim or "sub").strip()
    if not _CLAIM.fullmatch(claim):
        raise UsageError(f"REG_OIDC_CLAIM={claim[:64]!r} is not a claim name", "e.g. sub, email")
    config = OidcConfig(
        issuer,
        audience,
        jwks,
        claim,
        _algorithms(settings.oidc_algorithms),
        _prefix(settings.oidc_principal_prefix),
        _require(settings.oidc_require),
    )
    if jwks.startswith("http://") and not _loopback(jwks):
        raise UsageError(
            f"REG_OIDC_JWKS={redact_url(jwks)}: plain http lets anyone on the path swap the keys",
            "use the provider's https:// jwks_uri (http:// only for 127.0.0.1, ::1, localhost)",
        )
    if not config.jwks_is_url:
        if "://" in jwks:
            raise UsageError(
                f"REG_OIDC_JWKS={redact_url(jwks)}: only https://, http:// or a file path",
                "point it at the provider's jwks_uri, or a JWKS file",
            )
        if not Path(jwks).expanduser().is_file():
            raise UsageError(f"REG_OIDC_JWKS={jwks}: no such file", "a JWKS JSON file, or a URL")
    return config


def _loopback(url: str) -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    try:
        host = (urlsplit(url).hostname or "").lower()
    except ValueError:
        return False
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _prefix(text: str | None) -> str:
    prefix = (text or "").strip()
    if prefix and not _PREFIX.fullmatch(prefix):
        raise UsageError(
            f"REG_OIDC_PRINCIPAL_PREFIX={prefix[:64]!r} cannot start a principal name",
            "letters, digits, . _ @ -, starting with a letter or digit, at most 64 (e.g. oidc-)",
        )
    return prefix


def _require(text: str | None) -> tuple[tuple[str, str], ...]:
    pairs: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        claim, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not _CLAIM.fullmatch(claim) or not value:
            raise UsageError(
                f"REG_OIDC_REQUIRE: {item.strip()[:64]!r} is not claim=value",
                "comma-separated claim=value pairs, e.g. repository_owner=my-org",
            )
        if pairs.get(claim, value) != value:
            raise UsageError(
                f"REG_OIDC_REQUIRE names {claim} twice with different values",
                "no JWT could match both; keep one",
            )
        pairs[claim] = value
    return tuple(pairs.items())


def _algorithms(text: str | None) -> tuple[str, ...]:
    if not text or not text.strip():
        return DEFAULT_ALGORITHMS
    names = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    for name in names:
        if name.lower() == "none" or name.upper().startswith("HS"):
            raise UsageError(
                f"REG_OIDC_ALGORITHMS: {name} is refused",
                "only asymmetric algorithms: the JWKS is public, so a symmetric or absent "
                f"signature proves nothing (allowed: {', '.join(ASYMMETRIC)})",
            )
        if name not in ASYMMETRIC:
            raise UsageError(
                f"REG_OIDC_ALGORITHMS: unknown algorithm {name[:32]!r}",
                f"allowed: {', '.join(ASYMMETRIC)}",
            )
    if not names:
        raise UsageError("REG_OIDC_ALGORITHMS names no algorithm", "e.g. RS256,ES256")
    return names


# -- verification --------------------------------------------------------------------------------


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
        from policies.loader import PRINCIPAL
        from registry.lifecycle.token_admin import SERVER_PRINCIPAL

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

    from registry.timeutil import iso

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
