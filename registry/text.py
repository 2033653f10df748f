"""Text that reaches a terminal, a log or another process: inert and free of secrets.

- `inert`: control characters (C0, C1, DEL, and every other non-printable code point such as
  bidirectional overrides) escaped as `\\xNN` / `\\uNNNN`, so a crafted name or reason cannot move
  the cursor, rewrite a line or hide text.
- `check_reason`: a free-text reason (pin, deprecate, yank) is one printable line of bounded
  length.
- `redact_url`: the password (or a token used as the user) in a URL's userinfo replaced by
  `***`; `redact` does it for every URL inside a message.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MAX_REASON = 500
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


def check_reason(reason: str | None, what: str = "reason") -> str | None:
    from registry.errors import UsageError  # errors imports this module

    if reason is None:
        return None
    if len(reason) > MAX_REASON:
        raise UsageError(
            f"the {what} is {len(reason)} characters", f"keep it to {MAX_REASON} or fewer"
        )
    if not reason.isprintable():
        raise UsageError(
            f"the {what} {inert(reason[:60])!r} holds control characters",
            "write it on one line, printable characters only",
        )
    return reason


def redact_url(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    user, has_password, _ = userinfo.partition(":")
    shown = f"{user}:***" if has_password else "***"
    return urlunsplit(parts._replace(netloc=f"{shown}@{host}"))


def redact(text: str) -> str:
    """Every URL in `text` with its credentials replaced."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text)
