"""`python -m registry.integrations.webhooks [--budget S]`: the embedded deliverer a command starts
(`webhooks.spawn`). It delivers as the registry's own process, not as a user: the
policy in force names the subscribers; one line of JSON goes to REG_HOME/webhooks.log."""

from __future__ import annotations

import argparse
import json
import sys

from registry.api.local import LocalRegistry
from registry.core.config import Settings
from registry.core.timeutil import now
from registry.integrations.webhooks.deliver import drain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registry.integrations.webhooks")
    parser.add_argument("--budget", type=float, default=60.0)
    args = parser.parse_args(argv)
    with LocalRegistry(Settings.from_env()) as reg:
        ctx = reg.context
        hooks = ctx.policy.rules.webhooks
        out = drain(ctx.catalog, hooks, args.budget, ctx.actor, ctx.policy.since, ctx.audit_key)
    print(json.dumps({"ts": now(), **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
