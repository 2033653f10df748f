"""The `reg` command (cli/): exit codes, one-line errors, JSON, help, `reg show` as text."""
