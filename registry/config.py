"""Settings: environment `REG_*` over `REG_HOME/config.toml` over the embedded defaults (DESIGN §8).

Embedded defaults need no server: a SQLite catalog and a local object store under `REG_HOME`.
"""

from __future__ import annotations

import getpass
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from registry.errors import UsageError

_OIDC_KEYS = (
    "oidc_issuer",
    "oidc_audience",
    "oidc_jwks",
    "oidc_claim",
    "oidc_algorithms",
    "oidc_principal_prefix",
    "oidc_require",
)
_FILE_KEYS = {
    "catalog_url",
    "store_url",
    "mlflow_tracking_uri",
    "policy",
    "user",
    "url",
    "allow_http",
    "audit_key_file",
    *_OIDC_KEYS,
}
LOGIN_FILE = "login.json"  # `reg login`: {"url", "token"}, mode 0600


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    home: Path
    catalog_url: str
    store_url: str
    mlflow_tracking_uri: str
    policy_path: Path | None = None
    user: str = field(default_factory=getpass.getuser)
    user_source: str = "OS login"  # where `user` came from: REG_USER, config.toml, OS login
    busy_timeout_s: float = 30.0
    workers: int = 4
    url: str | None = None  # REG_URL: remote mode, through reg server (DESIGN §9)
    token: str | None = None  # REG_TOKEN, else the one `reg login` stored for `url`
    # REG_ALLOW_HTTP=1 (allow_http = true): an http:// REG_URL to a host that is not loopback,
    # which sends the token in cleartext; refused without it (`check_cleartext`)
    allow_http: bool = False
    # REG_AUDIT_KEY_FILE: the audit log's HMAC key (`registry.audit_chain`); None: audit.key
    # under REG_HOME. Only reg server (and an operator on its host) can read it.
    audit_key_file: Path | None = None
    # OIDC bearer JWTs accepted by reg server (checked by registry/server/oidc.py): REG_OIDC_*
    oidc_issuer: str | None = None
    oidc_audience: str | None = None
    oidc_jwks: str | None = None  # a JWKS file or an http(s) URL
    oidc_claim: str | None = None  # the claim naming the principal (None: sub)
    oidc_algorithms: str | None = None  # comma-separated (None: the asymmetric defaults)
    oidc_principal_prefix: str | None = None  # prepended to the claim (e.g. oidc-)
    oidc_require: str | None = None  # comma-separated claim=value pairs that must all match

    @property
    def remote(self) -> bool:
        return bool(self.url)

    @property
    def audit_key_path(self) -> Path:
        return self.audit_key_file or self.home / "audit.key"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        home = Path(env.get("REG_HOME") or Path.home() / ".reg").expanduser().absolute()
        file_values = _read_config_file(home / "config.toml")

        def pick(env_key: str, file_key: str, default: str) -> str:
            return env.get(env_key) or file_values.get(file_key) or default

        policy = pick("REG_POLICY", "policy", "")
        try:
            busy = float(env.get("REG_BUSY_TIMEOUT", "30"))
            workers = int(env.get("REG_WORKERS", "4"))
        except ValueError as exc:
            raise UsageError(
                f"bad number in environment: {exc}", "REG_BUSY_TIMEOUT and REG_WORKERS are numbers"
            ) from exc
        user, source = _identity(env, file_values)
        url = (env.get("REG_URL") or file_values.get("url") or "").rstrip("/") or None
        token = env.get("REG_TOKEN") or (_logged_in(home, url) if url else None)
        if env.get("REG_ALLOW_HTTP"):
            allow_http = _flag("REG_ALLOW_HTTP", env["REG_ALLOW_HTTP"])
        else:
            allow_http = _flag("allow_http in config.toml", file_values.get("allow_http", ""))
        oidc = {k: pick(f"REG_{k.upper()}", k, "") or None for k in _OIDC_KEYS}
        audit_key = pick("REG_AUDIT_KEY_FILE", "audit_key_file", "")
        return cls(
            url=url,
            token=token,
            allow_http=allow_http,
            home=home,
            catalog_url=pick("REG_CATALOG_URL", "catalog_url", f"sqlite:///{home / 'catalog.db'}"),
            store_url=pick("REG_STORE_URL", "store_url", (home / "store").as_uri()),
            mlflow_tracking_uri=pick(
                "MLFLOW_TRACKING_URI", "mlflow_tracking_uri", f"sqlite:///{home / 'mlflow.db'}"
            ),
            policy_path=Path(policy).expanduser() if policy else None,
            user=user,
            user_source=source,
            busy_timeout_s=busy,
            workers=max(1, workers),
            audit_key_file=Path(audit_key).expanduser().absolute() if audit_key else None,
            oidc_issuer=oidc["oidc_issuer"],
            oidc_audience=oidc["oidc_audience"],
            oidc_jwks=oidc["oidc_jwks"],
            oidc_claim=oidc["oidc_claim"],
            oidc_algorithms=oidc["oidc_algorithms"],
            oidc_principal_prefix=oidc["oidc_principal_prefix"],
            oidc_require=oidc["oidc_require"],
        )


def _flag(source: str, value: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise UsageError(f"{source} is {value[:40]!r}, not a yes or no", "use 1 or 0 (true or false)")


def check_cleartext(url: str, allow_http: bool) -> None:
    """Refuse a plain http:// server URL whose host is not loopback (the bearer token would
    cross the network in cleartext) unless `allow_http` (REG_ALLOW_HTTP) says it is meant.
    The host is judged by its text, never resolved: a name that resolves to loopback today
    may not tomorrow, so only `localhost`, 127.0.0.0/8 and ::1 pass without the setting."""
    from registry.text import redact_url

    if url.lower().startswith("http://") and not allow_http and not loopback_url(url):
        raise UsageError(
            f"refusing {redact_url(url)}: plain http would send the bearer token in cleartext "
            "to a host that is not loopback",
            "use https://, or set REG_ALLOW_HTTP=1 or allow_http = true in config.toml where "
            "the network is trusted",
        )


def loopback_url(url: str) -> bool:
    """The URL's host is `localhost` or a loopback address (127.0.0.0/8, ::1, and IPv4-mapped
    ::ffff:127.x)."""
    import ipaddress
    from urllib.parse import urlsplit

    try:
        host = (urlsplit(url).hostname or "").lower()
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def _identity(env: dict[str, str], file_values: dict[str, str]) -> tuple[str, str]:
    """The embedded identity and where it came from: asserted, not proven (DESIGN §9)."""
    if env.get("REG_USER"):
        return checked_user(env["REG_USER"], "REG_USER"), "REG_USER"
    if file_values.get("user"):
        return checked_user(file_values["user"], "config.toml"), "config.toml"
    return _login_name(), "OS login"


MAX_USER = 256


def checked_user(name: str, source: str) -> str:
    """The name goes into the catalog, the audit log and MLflow: printable, one line, bounded
    (a NUL, which PostgreSQL refuses, would otherwise fail a push after its bytes moved)."""
    if len(name) > MAX_USER or not name.isprintable() or name != name.strip():
        raise UsageError(
            f"{source} is not a usable user name ({name[:40]!r})",
            f"use printable characters, no surrounding spaces, at most {MAX_USER}",
        )
    return name


def _login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid{os.getuid()}"


def _logged_in(home: Path, url: str) -> str | None:
    """The token `reg login` stored for `url`, if any (a login for another URL is not used)."""
    import json

    try:
        doc = json.loads((home / LOGIN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(doc, dict) and doc.get("url") == url and isinstance(doc.get("token"), str):
        return str(doc["token"])
    return None


def _read_config_file(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, OSError) as exc:
        raise UsageError(f"{path}: cannot read config: {exc}", "fix or remove the file") from exc
    unknown = set(data) - _FILE_KEYS
    if unknown:
        raise UsageError(
            f"{path}: unknown key(s) {', '.join(sorted(unknown))}",
            f"allowed keys: {', '.join(sorted(_FILE_KEYS))}",
        )
    # A TOML list (oidc_algorithms = ["RS256", "ES256"]) reads as the comma-separated form.
    return {k: ",".join(map(str, v)) if isinstance(v, list) else str(v) for k, v in data.items()}
