"""The release workflow's rules, pure: which aliases are protected and who may ask
or approve, which events a webhook may name, and which addresses the server may send to.

Protected aliases. A `[[protected_aliases]]` entry covers an alias (a name or glob) of the
models its globs match; the first entry that covers an alias is the one in force. `approvers`
and `requesters` list principals or `role:NAME`; a role includes the roles above it (an admin
may approve where `role:releaser` may), and only a grant covering the model counts. With no
grants at all (single-user mode) every principal holds every role: the four-eyes rule still
holds, but names there are asserted, not proven (DESIGN §9).

Addresses. The server holds the catalog and store credentials, so where it sends requests is
an attack surface: link-local and cloud metadata addresses are always refused; loopback,
private, shared and unique-local ranges only for a subscriber with `allow_private` (which also
allows plain http); multicast, reserved and unspecified never.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from policies.access import Grant, gives, is_scoped_admin


class AliasRule(Protocol):
    """What matching reads of a protected alias (`policies.loader.ProtectedAlias`, whose module
    imports this one)."""

    @property
    def alias(self) -> str: ...
    @property
    def models(self) -> list[str]: ...


R = TypeVar("R", bound=AliasRule)
G = TypeVar("G", bound=Grant)

# What a subscriber may ask for, as the receiver sees it in the body's `event`.
WEBHOOK_EVENTS = (
    "checkpoint.committed",
    "checkpoint.deleted",
    "validation.recorded",
    "release.promoted",
    "release.deprecated",
    "release.yanked",
    "alias.requested",
    "alias.approved",
    "alias.rejected",
    "alias.moved",
)

# Cloud metadata services reachable at addresses that are not link-local.
_METADATA = frozenset(
    ipaddress.ip_address(a) for a in ("100.100.100.200", "fd00:ec2::254", "168.63.129.16")
)
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: private in practice


# -- protected aliases ----------------------------------------------------------------------


def protection_for(rules: Sequence[R], model: str, alias: str) -> R | None:
    """The first rule covering `model@alias`, or None: the alias moves freely."""
    for rule in rules:
        if fnmatch.fnmatchcase(alias, rule.alias) and any(
            fnmatch.fnmatchcase(model, g) for g in rule.models
        ):
            return rule
    return None


def named_by(
    entries: Sequence[str],
    principal: str,
    grants: Sequence[G],
    *,
    single_user: bool,
    covers: Callable[[G], bool] | None = None,
) -> bool:
    """Is `principal` one of `entries` (names or `role:NAME`)? A role counts through the
    principal's grants that `covers` (a predicate on a grant: it covers the model) accepts;
    in single-user mode everyone holds every role."""
    for entry in entries:
        role = entry.removeprefix("role:")
        if role == entry:
            if entry == principal:
                return True
            continue
        if single_user:
            return True
        for grant in grants:
            if principal not in grant.principals or is_scoped_admin(grant):
                continue
            if gives(grant.role, role) and (covers is None or covers(grant)):
                return True
    return False


# -- where the server may send --------------------------------------------------------------


def check_url(url: str, *, allow_private: bool) -> None:
    """Raise ValueError unless `url` is one the server may POST to (before resolving it):
    https (http only with allow_private), a host, no credentials or fragment, and where the
    host is an address, one `address_problem` accepts."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"url {url!r} cannot be parsed: {exc}") from None
    schemes = ("https", "http") if allow_private else ("https",)
    if parts.scheme not in schemes:
        raise ValueError(
            f"url {url!r} must be https"
            + ("" if allow_private else " (http only with allow_private = true)")
        )
    if not parts.hostname:
        raise ValueError(f"url {url!r} names no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"url {url!r} carries credentials: put the secret in secret_file")
    if parts.fragment:
        raise ValueError(f"url {url!r} has a fragment")
    if port == 0:
        raise ValueError(f"url {url!r} names port 0")
    try:
        address = ipaddress.ip_address(parts.hostname)
    except ValueError:
        return  # a name: checked at each send, address by address
    problem = address_problem(address, allow_private=allow_private)
    if problem:
        raise ValueError(f"url {url!r}: {problem}")


def address_problem(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, *, allow_private: bool
) -> str | None:
    """Why the server must not connect to `address` (None: it may)."""
    if isinstance(address, ipaddress.IPv6Address):
        # an IPv4 address inside (::ffff:169.254.169.254, 6to4 2002:a9fe:a9fe::, Teredo's
        # client) is judged as that address too
        if address.ipv4_mapped is not None:  # the same address, as IPv4 (the kernel's view)
            return address_problem(address.ipv4_mapped, allow_private=allow_private)
        inner = address.sixtofour or (address.teredo or (None, None))[1]
        if inner is not None:
            problem = address_problem(inner, allow_private=allow_private)
            if problem:
                return f"{address} carries {problem}"
        if address.is_site_local:  # fec0::/10, deprecated but still routed privately
            return (
                None
                if allow_private
                else f"{address} is a site-local address: allowed only with allow_private"
            )
    if address.is_link_local or address in _METADATA:
        return f"{address} is link-local or a cloud metadata address: never allowed"
    private = address.is_loopback or address.is_private or address in _SHARED
    reserved = address.is_reserved and not address.is_loopback  # ::1 is in a reserved block
    if address.is_unspecified or address.is_multicast or reserved:
        return f"{address} is not a unicast address a receiver listens on"
    if private and not allow_private:
        return f"{address} is a loopback or private address: allowed only with allow_private"
    if not private and not address.is_global:
        return f"{address} is not a global address"
    return None
