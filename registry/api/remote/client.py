"""The HTTP side of remote mode: one `httpx.Client` per Registry, errors translated back.

A server error body `{"exit_code", "message", "hint", "type"}` becomes the RegistryError of that
type (so the CLI prints the same line and exits with the same code as embedded); 401 and 403
are always exit 4. A server that cannot be reached is one line naming REG_URL.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

from registry import errors
from registry.core.config import check_cleartext
from registry.errors import PermissionDenied, RegistryError, Unauthenticated, UsageError
from registry.text import redact_url

API = "/v1"
LONG_READ_S = 6 * 3600.0  # a promotion or a GC answers when it is done


class Client:
    def __init__(
        self, url: str, token: str | None, *, allow_http: bool = False, timeout_s: float = 30.0
    ) -> None:
        """Nothing goes over the network here; a URL that would carry the token in cleartext
        (http:// to a host that is not loopback) is refused unless `allow_http`."""
        if not url.startswith(("http://", "https://")):
            raise UsageError(
                f"REG_URL={redact_url(url)} is not an http(s) URL", "e.g. https://reg.example.com"
            )
        check_cleartext(url, allow_http)
        self.url = url.rstrip("/")
        if not token:
            raise Unauthenticated(
                f"no token for {redact_url(self.url)}",
                "reg login URL, or set REG_TOKEN (an admin mints one with reg token create)",
            )
        self.http = httpx.Client(
            base_url=self.url + API,
            headers={"authorization": f"Bearer {token}", "user-agent": "reg"},
            timeout=httpx.Timeout(timeout_s, read=LONG_READ_S),
            follow_redirects=False,
        )

    def close(self) -> None:
        self.http.close()

    def call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
        content: Iterable[bytes] | None = None,
    ) -> Any:
        """The JSON answer of one request, or the RegistryError the server reported."""
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self.http.request(method, path, params=clean, json=body, content=content)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if response.status_code >= 400:
            raise error_from(response)
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RegistryError(
                f"{redact_url(self.url)} answered {path} with something that is not JSON",
                "check REG_URL: is it reg server (not a proxy's page)?",
            ) from None

    def read(self, ref: str, path: str, *, offset: int | None = None, length: int = 0) -> bytes:
        """One file of `ref`, whole or `length` bytes from `offset`."""
        headers = {}
        if offset is not None:
            headers["range"] = f"bytes={offset}-{offset + length - 1}"
        try:
            response = self.http.get("/read", params={"ref": ref, "path": path}, headers=headers)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if response.status_code >= 400:
            raise error_from(response)
        return response.content

    def stream(self, ref: str, path: str) -> Iterator[bytes]:
        try:
            with self.http.stream("GET", "/read", params={"ref": ref, "path": path}) as response:
                if response.status_code >= 400:
                    response.read()
                    raise error_from(response)
                yield from response.iter_bytes(1 << 20)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc

    def _unreachable(self, exc: httpx.HTTPError) -> RegistryError:
        return RegistryError(
            f"cannot talk to {redact_url(self.url)}: {type(exc).__name__}: {exc}".rstrip(": "),
            "check REG_URL, the network, and that reg server runs there",
        )


def error_from(response: httpx.Response) -> RegistryError:
    """The RegistryError a server error response stands for."""
    try:
        doc = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("message"), str):
        text = response.text.strip().splitlines()[0][:200] if response.text.strip() else ""
        error: RegistryError = RegistryError(
            f"the server answered HTTP {response.status_code} {text}".strip(),
            "check REG_URL: is it reg server (not a proxy's error page)?",
        )
        if response.status_code in (401, 403):
            error = PermissionDenied(error.message, error.hint)
        return error
    hint = doc.get("hint") if isinstance(doc.get("hint"), str) else None
    kind = getattr(errors, str(doc.get("type")), None)
    if (
        isinstance(kind, type)
        and issubclass(kind, RegistryError)
        and kind is not errors.ObjectExists
    ):
        error = kind.__new__(kind)
        RegistryError.__init__(error, doc["message"], hint)
    else:
        error = RegistryError(doc["message"], hint)
        code = doc.get("exit_code")
        if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 126:
            error.exit_code = code
    if response.status_code in (401, 403) and not isinstance(error, PermissionDenied):
        error = PermissionDenied(error.message, error.hint)
    return error
