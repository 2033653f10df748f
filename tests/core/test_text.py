"""Text that reaches a terminal or a log is inert, reasons are bounded, URLs lose their secrets."""

from __future__ import annotations

import json

import pytest

from registry.core.refs import check_reason
from registry.text import inert, redact, redact_url


def test_inert_escapes_every_control_character():
    assert inert("plain name-1.2") == "plain name-1.2"
    assert inert("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert inert("line\nbreak\rback\x07") == "line\\x0abreak\\x0dback\\x07"
    assert inert("evil\u202egnp.exe") == "evil\\u202egnp.exe"  # right-to-left override
    assert inert("\x9b31m") == "\\x9b31m"  # C1 CSI


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://reg:s3cret@db:5432/reg", "postgresql+psycopg://reg:***@db:5432/reg"),
        ("https://token123@mlflow.internal/", "https://***@mlflow.internal/"),
        ("sqlite:////home/a/.reg/catalog.db", "sqlite:////home/a/.reg/catalog.db"),
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("postgresql+psycopg://u:s3cr3t@[::1/db", "postgresql+psycopg://u:***@[::1/db"),
        (
            "postgresql://h/db?password=s3cr3t&sslmode=on",
            "postgresql://h/db?password=***&sslmode=on",
        ),
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),
    ],
)
def test_urls_lose_their_credentials(url, shown):
    assert redact_url(url) == shown
    assert (
        redact(f"cannot open catalog '{url}': refused") == f"cannot open catalog '{shown}': refused"
    )


def test_reasons_are_one_bounded_printable_line():
    assert check_reason("paper baseline") == "paper baseline"
    for bad in ("x" * 501, "two\nlines", "bell\x07"):
        with pytest.raises(Exception, match="reason"):
            check_reason(bad)


def test_a_hostile_reason_is_refused_and_stored_text_prints_inert(cli, ckpts):
    assert cli("push-ckpt", ckpts.ws2.step_dir(2), "--run", "r", "--step", "2").returncode == 0
    res = cli("pin", "r@step2", "--reason", "ok\x1b]0;pwned\x07")
    assert res.returncode == 2 and "control characters" in res.stderr
    assert "\x1b" not in res.stderr
    res = cli("pin", "r@step2", "--reason", "y" * 501)
    assert res.returncode == 2 and "501 characters" in res.stderr
    # A reason written into the catalog behind reg's back still reaches the terminal inert.
    from sqlalchemy import text

    from registry import Registry

    with Registry() as reg, reg.catalog.engine.begin() as conn:
        conn.execute(text("UPDATE checkpoint SET pinned = true, pin_reason = :r"), {"r": "\x1b[2J"})
    shown = cli("show", "r@step2")
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "\\x1b[2J" in shown.stdout
    assert json.loads(cli("show", "r@step2", "--json").stdout)["pin_reason"] == "\x1b[2J"


def test_a_catalog_password_never_reaches_the_terminal(cli):
    url = "postgresql+psycopg://reg:hunter2@127.0.0.1:1/nothing"
    res = cli("ls", "--json", env={"REG_CATALOG_URL": url})
    assert res.returncode != 0
    assert "hunter2" not in res.stderr and "hunter2" not in res.stdout
    assert "reg:***@127.0.0.1" in res.stderr


def test_a_store_url_with_credentials_is_refused_without_showing_them(cli):
    res = cli("ls", env={"REG_STORE_URL": "s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/prefix"})
    assert res.returncode == 2
    assert "carries credentials" in res.stderr and "wJalrXUtnFEMI" not in res.stderr
