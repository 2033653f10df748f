"""Pure decision code (policies/): resume rules by key path, the retention planner."""
