"""The provable audit log (DESIGN §9): edits, reordering, deletions, forged inserts and the
truncation of the tail back to the last anchor are detected, even when done by the database's
owner, who can drop or disable the append-only triggers.

    keys.py      the server's secret (REG_AUDIT_KEY_FILE); only the server holds it
    macs.py      exactly what is signed: events, seals, anchors
    sealer.py    chains signed events into append-only seals (one sealer, a lease)
    anchors.py   the chain head, written once to the object store (Object Lock where possible)
    verify.py    `reg audit verify`: every MAC, seal, link and anchor; each problem named
    schedule.py  the server's sealing loop
    service.py   `seal` and `verify` on a Context (admin)

Replicas never serialize on a shared row: each request signs its own event at insert (a MAC of
its content and a random uid), and only the sealer, one at a time, links events into the chain.
"""
