"""The decision journal and its replay by `reg catalog rebuild` (registry/journal/)."""
