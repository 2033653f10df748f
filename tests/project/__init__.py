"""The project as a whole: the import graph and its layers, the packaging contract, the
documentation, and the suite's own sharing machinery (tests/sharing.py)."""
