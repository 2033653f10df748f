"""The basics (registry/core/, registry/text.py): settings, refs, inert text."""
