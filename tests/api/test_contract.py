"""One registry contract (`registry.api.contract.Registry`), two implementations: mypy checks each
method's signature against the contract (both subclass it); this checks that neither leaves one
out, and that `Registry(...)` opens the one the settings name."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from registry import Registry, Settings
from registry.api.local import LocalRegistry
from registry.api.remote.registry import RemoteRegistry


def _contract() -> list[str]:
    return [
        name
        for name, member in vars(Registry).items()
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    ]


def _defined_by(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in vars(c))


@pytest.mark.parametrize("implementation", [LocalRegistry, RemoteRegistry])
def test_each_implementation_defines_every_method_of_the_contract(implementation):
    contract = _contract()
    assert len(contract) >= 40 and "push_checkpoint" in contract and "user" in contract
    # defined by the implementation (or a mixin of its), not left to the contract's own
    missing = [name for name in contract if _defined_by(implementation, name) is Registry]
    assert missing == []
    for name in contract:  # and with the contract's parameters, in the same order
        ours, theirs = getattr(implementation, name), getattr(Registry, name)
        if isinstance(theirs, property):
            continue
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(theirs).parameters
        ), name


def test_registry_opens_the_embedded_one_or_the_server(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("REG_URL", raising=False)
    monkeypatch.setenv("REG_HOME", str(tmp_path / "home"))
    with Registry() as embedded:
        assert type(embedded) is LocalRegistry and isinstance(embedded, Registry)
    remote_settings = Settings.from_env({"REG_URL": "https://reg.example", "REG_TOKEN": "reg_a_b"})
    remote = Registry(remote_settings)
    assert type(remote) is RemoteRegistry and isinstance(remote, Registry)
    assert remote.settings is remote_settings
    remote.close()
    assert type(LocalRegistry(Settings.from_env({"REG_HOME": str(tmp_path)}))) is LocalRegistry
