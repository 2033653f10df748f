"""`python -m registry.integrations.webhooks [--budget S]`: the embedded deliverer a command starts
(`core.detached.spawn_deliverer`). It delivers as the registry's own process, not as a user: the
policy in force names the subscribers; one line of JSON goes to REG_HOME/webhooks.log."""

from __future__ import annotations

import argparse
import json
import sys

from registry.catalog.engine import Catalog
from registry.core.config import Settings
from registry.core.timeutil import now
from registry.integrations.webhooks.deliver import drain
from registry.storage import open_store
from registry.trust.audit_chain import keys
from registry.trust.policy_source import EffectivePolicy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registry.integrations.webhooks")
    parser.add_argument("--budget", type=float, default=60.0)
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    catalog = Catalog.of(settings.catalog)
    try:
        key = keys.optional(settings.audit_key_path)
        policy = EffectivePolicy.in_force(
            catalog, settings, key, lambda: open_store(settings.store_url, s3=settings.s3)
        )
        # The embedded identity, as every command of this registry's user acts under.
        out = drain(catalog, policy.rules.webhooks, args.budget, settings.user, policy.since, key)
    finally:
        catalog.dispose()
    print(json.dumps({"ts": now(), **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
