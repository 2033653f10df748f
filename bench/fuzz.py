"""The fuzzer of tests/formats/test_fuzz.py at length: many more examples, a random seed each run.

    python -m bench.fuzz [--examples 20000]

The suite runs 150 examples per property with a fixed seed (a few tens of seconds); this runs
the same properties (refs, documents, policies, mutated real `.metadata`) with fresh
randomness, and hypothesis prints the smallest failing input when it finds one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from bench.common import ROOT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=20000)
    args = parser.parse_args()
    env = dict(os.environ, REG_FUZZ_EXAMPLES=str(args.examples), REG_FUZZ_RANDOM="1")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/formats/test_fuzz.py",
    ]
    sys.exit(subprocess.run(command, cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
