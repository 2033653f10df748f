"""The checkpoint lifecycle: push, read (show, pull, verify, pin), listing."""
