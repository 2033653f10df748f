"""Text that reaches a terminal, a log or another process: inert and free of secrets.

- `inert`: control characters (C0, C1, DEL, and every other non-printable code point such as
  bidirectional overrides) escaped as `\\xNN` / `\\uNNNN`, so a crafted name or reason cannot move
  the cursor, rewrite a line or hide text.
- `redact_url`: the password (or a token used as the user) in a URL's userinfo replaced by
  `***`; `redact` does it for every URL inside a message.
"""

from __future__ import annotations

import re

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def inert(text: str) -> str:
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return "".join(out)


_SECRET_PARAMETER = re.compile(
    r"(?i)([?&;](?:password|passwd|pwd|secret|token|access_token|api_key|apikey|key|sig|"
    r"signature|x-amz-signature|x-amz-credential|x-amz-security-token)=)[^&;#\s]*"
)


def redact_url(url: str) -> str:
    """The URL with its userinfo's password (or a lone user, often a token) shown as `***` and
    secret-looking query parameters blanked. Works on text no URL parser accepts, too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return _SECRET_PARAMETER.sub(r"\1***", url)
    authority_end = len(rest)
    for stop in "/?#":
        found = rest.find(stop, rest.rfind("@") + 1 if "@" in rest else 0)
        if found != -1:
            authority_end = min(authority_end, found)
    authority, tail = rest[:authority_end], rest[authority_end:]
    if "@" in authority:
        userinfo, _, host = authority.rpartition("@")
        user, has_password, _ = userinfo.partition(":")
        authority = f"{user}:***@{host}" if has_password else f"***@{host}"
    return f"{scheme}://{authority}" + _SECRET_PARAMETER.sub(r"\1***", tail)


def redact(text: str) -> str:
    """Every URL in `text` with its credentials replaced."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text)
