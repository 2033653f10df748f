"""The OIDC settings of `reg server` (`registry.server.oidc`): read, checked, refused whole.

All three of issuer, audience and JWKS, or none; asymmetric algorithms only; an http JWKS URL
only on a loopback host; a prefix and required claims that can make principal names. A partial
or unsafe setting stops `reg server` with one line (exit 2) rather than seem to work.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from registry.errors import UsageError
from registry.text import redact_url

if TYPE_CHECKING:
    from registry.core.config import Settings

ASYMMETRIC = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
    "ES256", "ES256K", "ES384", "ES512", "ES521", "EdDSA",
)  # fmt: skip
DEFAULT_ALGORITHMS = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA",
)  # fmt: skip
_CLAIM = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")  # the start of a principal name
_LOOPBACK_NAMES = ("localhost",)


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
        "REG_OIDC_ISSUER": settings.oidc.issuer,
        "REG_OIDC_AUDIENCE": settings.oidc.audience,
        "REG_OIDC_JWKS": settings.oidc.jwks,
    }
    present = [k for k, v in named.items() if v]
    extras = [
        k
        for k, v in {
            "REG_OIDC_CLAIM": settings.oidc.claim,
            "REG_OIDC_ALGORITHMS": settings.oidc.algorithms,
            "REG_OIDC_PRINCIPAL_PREFIX": settings.oidc.principal_prefix,
            "REG_OIDC_REQUIRE": settings.oidc.require,
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
    claim = (settings.oidc.claim or "sub").strip()
    if not _CLAIM.fullmatch(claim):
        raise UsageError(f"REG_OIDC_CLAIM={claim[:64]!r} is not a claim name", "e.g. sub, email")
    config = OidcConfig(
        issuer,
        audience,
        jwks,
        claim,
        _algorithms(settings.oidc.algorithms),
        _prefix(settings.oidc.principal_prefix),
        _require(settings.oidc.require),
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
