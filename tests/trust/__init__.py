"""Who may do what and the facts that prove it (registry/trust/): access policies and the
Principal, the provable audit log, signed facts, tokens, signed releases."""
