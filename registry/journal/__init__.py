"""The decision journal: what lives only in the catalog, also kept in the store.

Pins, yanks and deprecations, alias moves, applied policies (and with them the grants) and
validations are catalog rows that no MANIFEST.json or release.json records. Each is also written
to the store as one small append-only object under `journal/` (registry.core.layout), so that
`reg catalog rebuild` brings them back after the catalog is lost:

    event.py   the format (`reg.event/1`): strict parsing, the HMAC under the audit key
    write.py   `record`: the object is written before the catalog commits the decision, and
               marked aborted if that commit then fails
    replay.py  reads every event (refusing the malformed, oversized, unsigned or forged ones)
               and re-creates the catalog rows, idempotently, without side effects
    backfill.py  writes events for what a registry decided before it had a journal

The journal proves what it holds (with an audit key, every event is signed), not that nothing
was removed from it: whoever can delete objects in the store can delete events.
"""
