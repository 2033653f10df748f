"""Who may do what, and the facts that prove it: principals and tokens, the policy in force and the
signed facts decisions read, the audit log and its MAC chain, release signing keys and bundles."""
