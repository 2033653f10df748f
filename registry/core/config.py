"""Settings: environment `REG_*` over `REG_HOME/config.toml` over the embedded defaults (DESIGN §8).

Embedded defaults need no server: a SQLite catalog and a local object store under `REG_HOME`.
"""

from __future__ import annotations

import getpass
import ipaddress
import json
import math
import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from registry.core.timeutil import positive_duration
from registry.errors import UsageError
from registry.text import redact_url

_OIDC_KEYS = (
    "issuer",
    "audience",
    "jwks",
    "claim",
    "algorithms",
    "principal_prefix",
    "require",
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
    "signing_dir",
    "cache_dir",
    *(f"oidc_{k}" for k in _OIDC_KEYS),
}
LOGIN_FILE = "login.json"  # `reg login`: {"url", "token"}, mode 0600


def _var(env: str, default: str, meaning: str, *, file: str | None = None) -> Any:
    """A setting's documentation: its variable, its default as written, what it means, and its
    config.toml key (docs/reference/configuration.md's table is made from these: `reference()`)."""
    return {"env": env, "default": default, "meaning": meaning, "file": file}


@dataclass(frozen=True, kw_only=True, slots=True)
class CatalogSettings:
    url: str = field(
        metadata=_var(
            "REG_CATALOG_URL",
            "`sqlite:///$REG_HOME/catalog.db`",
            "any SQLAlchemy URL; PostgreSQL: `postgresql+psycopg://user@host/db`",
            file="catalog_url",
        )
    )
    busy_timeout_s: float = field(
        default=30.0,
        metadata=_var("REG_BUSY_TIMEOUT", "`30`", "seconds to wait for a locked SQLite catalog"),
    )
    reconnect_s: float = field(
        default=30.0,
        metadata=_var(
            "REG_CATALOG_RECONNECT",
            "`30`",
            "PostgreSQL: seconds a command that had reached the catalog waits for it to come "
            "back after a restart or failover (a catalog never reached fails at once)",
        ),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSettings:
    """`reg server`'s own: read when it starts (each worker process reads the same)."""

    header_timeout_s: float = field(
        default=15.0,
        metadata=_var(
            "REG_SERVER_HEADER_TIMEOUT",
            "`15`",
            "`reg server`: seconds a connection has to send a request's headers (slowloris)",
        ),
    )
    max_connections: int | None = field(
        default=None,
        metadata=_var(
            "REG_SERVER_MAX_CONNECTIONS",
            "min(1000, `ulimit -n` - 128)",
            "`reg server`: connections at once; one more evicts the longest waiting for headers",
        ),
    )
    idle_timeout_s: float = field(
        default=60.0,
        metadata=_var(
            "REG_SERVER_IDLE_TIMEOUT",
            "`60`",
            "`reg server`: seconds a request body may stop arriving before it is abandoned",
        ),
    )
    uploads: int = field(
        default=32,
        metadata=_var(
            "REG_SERVER_UPLOADS",
            "`32`",
            "`reg server`: file uploads received at once; one more waits (2 minutes at most)",
        ),
    )
    seal_every_s: float = field(
        default=10.0,
        metadata=_var(
            "REG_AUDIT_SEAL_EVERY",
            "`10s`",
            "`reg server`: how often the audit chain is sealed",
        ),
    )
    anchor_every_s: float = field(
        default=300.0,
        metadata=_var(
            "REG_AUDIT_ANCHOR_EVERY",
            "`5m`",
            "`reg server`: how often the chain's head is anchored in the store",
        ),
    )
    gc_every_s: float | None = field(
        default=None,
        metadata=_var(
            "REG_SERVER_GC_EVERY",
            "off",
            "`reg server`: run GC this often (`30m`, `6h`; `reg server --gc-every` sets it)",
        ),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class S3Settings:
    max_attempts: int = field(
        default=10,
        metadata=_var(
            "AWS_MAX_ATTEMPTS",
            "`10`",
            "S3 attempts per request, with backoff (fewer where a dead endpoint should be "
            "reported quickly); endpoint and credentials: `AWS_ENDPOINT_URL` and the other "
            "`AWS_*` variables and profiles",
        ),
    )
    retry_mode: str = field(
        default="adaptive",
        metadata=_var("REG_S3_RETRY_MODE", "`adaptive`", "botocore's retry mode (`standard`)"),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class OidcSettings:
    """OIDC bearer JWTs accepted by reg server (checked by registry/server/oidc.py)."""

    issuer: str | None = field(
        default=None,
        metadata=_var(
            "REG_OIDC_ISSUER",
            "",
            "`reg server`: accept the identity provider's JWTs (issuer, audience and JWKS: all "
            "three, or none)",
            file="oidc_issuer",
        ),
    )
    audience: str | None = field(
        default=None,
        metadata=_var(
            "REG_OIDC_AUDIENCE", "", "the `aud` the tokens must carry", file="oidc_audience"
        ),
    )
    jwks: str | None = field(
        default=None,
        metadata=_var("REG_OIDC_JWKS", "", "a JWKS file or an https URL", file="oidc_jwks"),
    )
    claim: str | None = field(
        default=None,
        metadata=_var(
            "REG_OIDC_CLAIM", "`sub`", "the claim naming the principal", file="oidc_claim"
        ),
    )
    algorithms: str | None = field(
        default=None,
        metadata=_var(
            "REG_OIDC_ALGORITHMS",
            "the asymmetric ones",
            "comma-separated signature algorithms accepted",
            file="oidc_algorithms",
        ),
    )
    principal_prefix: str | None = field(
        default=None,
        metadata=_var(
            "REG_OIDC_PRINCIPAL_PREFIX",
            "",
            "prepended to the claim (e.g. `oidc-`)",
            file="oidc_principal_prefix",
        ),
    )
    require: str | None = field(
        default=None,
        metadata=_var(
            "REG_OIDC_REQUIRE",
            "",
            "comma-separated `claim=value` pairs that must all match",
            file="oidc_require",
        ),
    )


@dataclass(frozen=True, kw_only=True, slots=True, repr=False)
class Settings:
    """Every setting, read once (`from_env`): the environment over `REG_HOME/config.toml` over
    the defaults. Its repr hides the token and any password in a URL."""

    home: Path = field(
        metadata=_var(
            "REG_HOME",
            "`~/.reg`",
            "holds `catalog.db`, `store/`, `mlflow.db`, `policy.toml`, `config.toml`",
        )
    )
    catalog: CatalogSettings
    store_url: str = field(
        metadata=_var(
            "REG_STORE_URL",
            "`file://$REG_HOME/store`",
            "`file:///path`, `s3://bucket/prefix`, or `memory://NAME` (inside one Python "
            "process only, nothing kept: for tests through the Python API; the CLI refuses it)",
            file="store_url",
        )
    )
    mlflow_tracking_uri: str = field(
        metadata=_var(
            "MLFLOW_TRACKING_URI",
            "`sqlite:///$REG_HOME/mlflow.db`",
            "where the mirror writes",
            file="mlflow_tracking_uri",
        )
    )
    policy_path: Path | None = field(
        default=None,
        metadata=_var(
            "REG_POLICY",
            "`$REG_HOME/policy.toml`, else the shipped default",
            "policy document (until one is applied to the catalog)",
            file="policy",
        ),
    )
    user: str = field(
        default_factory=getpass.getuser,
        metadata=_var(
            "REG_USER",
            "the OS login name",
            "who you are to the access policy and the audit log (embedded mode: asserted by "
            "whoever runs the command, not proven; ignored with `REG_URL`)",
            file="user",
        ),
    )
    user_source: str = "OS login"  # where `user` came from: REG_USER, config.toml, OS login
    workers: int = field(default=4, metadata=_var("REG_WORKERS", "`4`", "parallel file transfers"))
    url: str | None = field(
        default=None,
        metadata=_var(
            "REG_URL",
            "",
            "remote mode: every command goes to `reg server` at this URL "
            "(docs/concepts/design.md §9)",
            file="url",
        ),
    )
    token: str | None = field(
        default=None,
        metadata=_var(
            "REG_TOKEN",
            "the one `reg login` saved for `REG_URL`",
            "the bearer token of remote mode (`REG_HOME/login.json`, 0600)",
        ),
    )
    allow_http: bool = field(
        default=False,
        metadata=_var(
            "REG_ALLOW_HTTP",
            "`0`",
            "`1`: allow an `http://` `REG_URL` (or `reg login` URL) to a host that is not "
            "loopback, which sends the token in cleartext; refused otherwise (exit 2, before "
            "any connection). `localhost`, 127.0.0.0/8 and `::1` are always allowed; the host "
            "is judged as written, never resolved",
            file="allow_http",
        ),
    )
    audit_key_file: Path | None = field(
        default=None,
        metadata=_var(
            "REG_AUDIT_KEY_FILE",
            "`$REG_HOME/audit.key`",
            "`reg server`: the audit log's HMAC key (`reg server init` creates it); only the "
            "server and an operator on its host can read it",
            file="audit_key_file",
        ),
    )
    signing_dir_path: Path | None = field(
        default=None,
        metadata=_var(
            "REG_SIGNING_DIR",
            "`$REG_HOME/signing`",
            "where the release signing keys' private halves are (0700, each key 0600): the "
            "server's, shared by its replicas as the audit key is; `reg keys` and `reg server "
            "init` write there",
            file="signing_dir",
        ),
    )
    cache_dir_path: Path | None = field(
        default=None,
        metadata=_var(
            "REG_CACHE_DIR",
            "`$REG_HOME/cache`",
            "where `reg fetch-release` keeps verified release folders, one per release.json "
            "sha256 (`releases/MODEL/SHA256/`), on this machine (remote mode too)",
            file="cache_dir",
        ),
    )
    mlflow_drain: bool = field(
        default=True,
        metadata=_var(
            "REG_MLFLOW",
            "`on`",
            "`off`: no automatic drain to MLflow after a command (events still queue)",
        ),
    )
    server: ServerSettings = field(default_factory=ServerSettings)
    s3: S3Settings = field(default_factory=S3Settings)
    oidc: OidcSettings = field(default_factory=OidcSettings)

    @property
    def remote(self) -> bool:
        return bool(self.url)

    @property
    def audit_key_path(self) -> Path:
        return self.audit_key_file or self.home / "audit.key"

    @property
    def signing_dir(self) -> Path:
        """Where the release signing keys' private halves are (mode 0700, each key 0600)."""
        return self.signing_dir_path or self.home / "signing"

    @property
    def cache_dir(self) -> Path:
        """Where fetched releases are kept (`registry.api.consumers`)."""
        return self.cache_dir_path or self.home / "cache"

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["token"] = None if self.token is None else "***"
        for name in ("store_url", "mlflow_tracking_uri", "url"):
            if shown[name]:
                shown[name] = redact_url(str(shown[name]))
        catalog = replace(self.catalog, url=redact_url(self.catalog.url))
        shown["catalog"] = catalog
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        home = Path(env.get("REG_HOME") or Path.home() / ".reg").expanduser().absolute()
        file_values = _read_config_file(home / "config.toml")

        def pick(env_key: str, file_key: str, default: str) -> str:
            return env.get(env_key) or file_values.get(file_key) or default

        policy = pick("REG_POLICY", "policy", "")
        user, source = _identity(env, file_values)
        url = (env.get("REG_URL") or file_values.get("url") or "").rstrip("/") or None
        token = env.get("REG_TOKEN") or (_logged_in(home, url) if url else None)
        if env.get("REG_ALLOW_HTTP"):
            allow_http = _flag("REG_ALLOW_HTTP", env["REG_ALLOW_HTTP"])
        else:
            allow_http = _flag("allow_http in config.toml", file_values.get("allow_http", ""))
        audit_key = pick("REG_AUDIT_KEY_FILE", "audit_key_file", "")
        signing = pick("REG_SIGNING_DIR", "signing_dir", "")
        cache = pick("REG_CACHE_DIR", "cache_dir", "")
        number = _Numbers(env)
        return cls(
            url=url,
            token=token,
            allow_http=allow_http,
            home=home,
            catalog=CatalogSettings(
                url=pick("REG_CATALOG_URL", "catalog_url", f"sqlite:///{home / 'catalog.db'}"),
                busy_timeout_s=number.seconds("REG_BUSY_TIMEOUT", 30.0),
                reconnect_s=number.seconds("REG_CATALOG_RECONNECT", 30.0),
            ),
            store_url=pick("REG_STORE_URL", "store_url", (home / "store").as_uri()),
            mlflow_tracking_uri=pick(
                "MLFLOW_TRACKING_URI", "mlflow_tracking_uri", f"sqlite:///{home / 'mlflow.db'}"
            ),
            policy_path=Path(policy).expanduser() if policy else None,
            user=user,
            user_source=source,
            workers=max(1, number.whole("REG_WORKERS", 4)),
            audit_key_file=Path(audit_key).expanduser().absolute() if audit_key else None,
            signing_dir_path=Path(signing).expanduser().absolute() if signing else None,
            cache_dir_path=Path(cache).expanduser().absolute() if cache else None,
            mlflow_drain=env.get("REG_MLFLOW", "on").lower() not in ("off", "0", "false", "no"),
            server=_server(env, number),
            s3=S3Settings(
                max_attempts=max(1, number.whole("AWS_MAX_ATTEMPTS", 10)),
                retry_mode=env.get("REG_S3_RETRY_MODE") or "adaptive",
            ),
            oidc=OidcSettings(
                **{k: pick(f"REG_OIDC_{k.upper()}", f"oidc_{k}", "") or None for k in _OIDC_KEYS}
            ),
        )


class _Numbers:
    """Numbers from the environment; a bad one is one line naming the variable."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def seconds(self, name: str, default: float, *, most: float = 10**9) -> float:
        text = self.env.get(name) or ""
        if not text:
            return default
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 <= value <= most:
            raise UsageError(
                f"{name}={text[:40]!r} is not a number of seconds", f"give 0 to {most:g}"
            )
        return value

    def whole(self, name: str, default: int) -> int:
        text = self.env.get(name) or ""
        if not text:
            return default
        try:
            return int(text)
        except ValueError:
            raise UsageError(
                f"{name}={text[:40]!r} is not a whole number", "unset it, or give a number"
            ) from None


def _server(env: dict[str, str], number: _Numbers) -> ServerSettings:
    header = number.seconds("REG_SERVER_HEADER_TIMEOUT", 15.0, most=3600)
    if header == 0:
        raise UsageError("REG_SERVER_HEADER_TIMEOUT is 0", "give 1 to 3600 seconds")
    connections = number.whole("REG_SERVER_MAX_CONNECTIONS", 0) or None
    if connections is not None and connections < 1:
        raise UsageError(
            f"REG_SERVER_MAX_CONNECTIONS must be at least 1, got {connections}",
            "unset it, or give a positive number",
        )
    gc_every = env.get("REG_SERVER_GC_EVERY")
    seal = positive_duration(env.get("REG_AUDIT_SEAL_EVERY") or "10s", "REG_AUDIT_SEAL_EVERY")
    anchor = positive_duration(
        env.get("REG_AUDIT_ANCHOR_EVERY") or "5m", "REG_AUDIT_ANCHOR_EVERY", "5m"
    )
    return ServerSettings(
        header_timeout_s=header,
        max_connections=connections,
        idle_timeout_s=number.seconds("REG_SERVER_IDLE_TIMEOUT", 60.0),
        uploads=max(1, number.whole("REG_SERVER_UPLOADS", 32)),
        seal_every_s=seal,
        anchor_every_s=anchor,
        gc_every_s=positive_duration(gc_every, "REG_SERVER_GC_EVERY") if gc_every else None,
    )


def reference() -> str:
    """The settings table of docs/reference/configuration.md, made from the settings' own
    documentation (`python -m cli.reference` writes it there)."""
    rows = ["| variable | config.toml | default | meaning |", "|---|---|---|---|"]

    def walk(kind: type) -> None:
        for f in fields(kind):
            if "env" in f.metadata:
                m = f.metadata
                key = f"`{m['file']}`" if m["file"] else ""
                rows.append(f"| `{m['env']}` | {key} | {m['default']} | {m['meaning']} |")
            elif isinstance(f.type, str) and f.type.endswith("Settings"):
                walk(globals()[f.type])

    walk(Settings)
    return "\n".join(rows) + "\n"


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
