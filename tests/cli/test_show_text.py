"""`reg show` as a person reads it: a headline, aligned facts, sections and tables; never a
raw `None` or `rank=None`; the raw shape stays behind --json."""

from __future__ import annotations

import json
import re

from cli.details import render_details


def test_show_prints_a_checkpoint_and_a_release_for_people(filled, cli):
    filled.pin("r@step4", reason="paper baseline")
    filled.set_alias("tiny", "prod", "v1")
    text = cli("show", "r@step4").stdout
    lines = text.splitlines()
    assert lines[0] == "checkpoint r@step4 (committed, pinned)"
    assert "None" not in text and "rank=" not in text
    assert re.search(r"^  pin reason +paper baseline$", text, re.M)
    assert re.search(r"^  world size +2$", text, re.M)
    assert re.search(r"^  bytes +1\.\d MiB$", text, re.M)
    files = lines[lines.index("files") + 1 :]
    assert files[0].split() == ["PATH", "SIZE", "SHA256", "RANK"]
    shown = json.loads(cli("show", "r@step4", "--json").stdout)  # the raw shape, unchanged
    digest = next(f["sha256"] for f in shown["files"] if f["path"] == "__1_0.distcp")
    assert re.search(rf"^  __1_0\.distcp +\S+ KiB +{digest[:16]}\.\.\. +1$", text, re.M)
    assert shown["pin_reason"] == "paper baseline" and shown["files"][0]["rank"] is None

    release = cli("show", "tiny@prod").stdout
    assert release.splitlines()[0] == "release tiny:v1 (active)"
    assert re.search(r"^  source +r@step4$", release, re.M) and "None" not in release
    assert re.search(r"^  version +v1$", release, re.M)
    history = release.splitlines()[release.splitlines().index("alias history") + 1 :]
    assert history[0].split() == ["ALIAS", "TO", "AT", "BY"]


def test_unknown_and_empty_fields_print_by_name_or_not_at_all():
    text = render_details(
        {
            "ref": "r@step1",
            "state": "committed",
            "resumable": False,
            "new_field": 7,
            "empty": None,
            "nothing": [],
            "nested": {"a": None, "b": True, "deeper": [{"x": 1, "y": None}]},
            "metrics": {"probe_loss": 1.5, "bytes": 7},  # the user's names, as they are
        }
    )
    assert text.splitlines()[0] == "checkpoint r@step1 (committed, not resumable)"
    assert "  new field  7" in text.splitlines() and "empty" not in text and "None" not in text
    assert "nested\n  b  yes\n  deeper\n    X\n    1\n" in text
    assert "metrics\n  probe_loss  1.5\n  bytes       7\n" in text
