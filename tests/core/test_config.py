"""Settings: read once, typed and nested, secrets hidden in their repr, and the configuration
reference (docs/reference/configuration.md) made from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.core.config import Settings, reference
from registry.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]


def test_the_configuration_reference_is_the_settings_own():
    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    assert reference() in page
    for var in ("REG_CATALOG_URL", "REG_SERVER_UPLOADS", "REG_OIDC_REQUIRE", "AWS_MAX_ATTEMPTS"):
        assert f"| `{var}` |" in reference()


def test_nested_settings_come_from_the_environment(tmp_path):
    env = {
        "REG_HOME": str(tmp_path),
        "REG_CATALOG_URL": "postgresql+psycopg://u@h/db",
        "REG_CATALOG_RECONNECT": "5",
        "REG_SERVER_UPLOADS": "8",
        "REG_SERVER_IDLE_TIMEOUT": "12",
        "REG_SERVER_GC_EVERY": "30m",
        "REG_AUDIT_SEAL_EVERY": "2s",
        "AWS_MAX_ATTEMPTS": "3",
        "REG_S3_RETRY_MODE": "standard",
        "REG_OIDC_ISSUER": "https://issuer.example",
        "REG_MLFLOW": "off",
    }
    s = Settings.from_env(env)
    assert (s.catalog.url, s.catalog.reconnect_s) == ("postgresql+psycopg://u@h/db", 5.0)
    assert (s.server.uploads, s.server.idle_timeout_s, s.server.gc_every_s) == (8, 12.0, 1800.0)
    assert (s.server.seal_every_s, s.server.anchor_every_s) == (2.0, 300.0)
    assert (s.s3.max_attempts, s.s3.retry_mode) == (3, "standard")
    assert s.oidc.issuer == "https://issuer.example" and s.oidc.audience is None
    assert s.mlflow_drain is False
    defaults = Settings.from_env({"REG_HOME": str(tmp_path)})
    assert defaults.server.max_connections is None and defaults.server.header_timeout_s == 15.0
    assert defaults.catalog.url == f"sqlite:///{tmp_path / 'catalog.db'}"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("REG_SERVER_UPLOADS", "many"),
        ("REG_SERVER_IDLE_TIMEOUT", "-1"),
        ("REG_CATALOG_RECONNECT", "soon"),
        ("AWS_MAX_ATTEMPTS", "2.5"),
        ("REG_WORKERS", "x"),
        ("REG_BUSY_TIMEOUT", "nan"),
    ],
)
def test_a_bad_number_is_one_line_naming_its_variable(tmp_path, name, value):
    with pytest.raises(UsageError, match=name):
        Settings.from_env({"REG_HOME": str(tmp_path), name: value})


def test_the_repr_hides_the_token_and_url_passwords(tmp_path):
    s = Settings.from_env(
        {
            "REG_HOME": str(tmp_path),
            "REG_TOKEN": "reg_secret_token",
            "REG_CATALOG_URL": "postgresql+psycopg://reg:hunter2@db/reg",
            "MLFLOW_TRACKING_URI": "postgresql://ml:swordfish@db/ml",
        }
    )
    shown = repr(s)
    assert "reg_secret_token" not in shown and "hunter2" not in shown
    assert "swordfish" not in shown
    assert "token='***'" in shown and "db/reg" in shown
    assert s.token == "reg_secret_token"  # only the repr hides it
