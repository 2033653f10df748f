"""Pure decision code and policy documents (DESIGN §2): retention, access, promotion gates,
resume-state classification, and the TOML loader. No I/O beyond reading a policy file."""

from pathlib import Path

DEFAULT_POLICY_PATH = Path(__file__).with_name("default.toml")
