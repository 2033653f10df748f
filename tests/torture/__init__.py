"""The torture suite (docs/development/torture.md): registry operations SIGKILLed at random
moments with every invariant checked after each kill, and faults injected into PostgreSQL, S3
and the disk."""
