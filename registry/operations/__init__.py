"""Operations on the whole registry, beside the two lifecycles: retention and its collection,
consistency and integrity, recovery, and administration.

    gc.py, logged_protections.py   `reg gc`: retention plans executed; the signed protections
    fsck.py, fsck_findings.py, fsck_repair.py   `reg fsck [--repair]`: catalog against store
    scrub.py                       `reg verify --all`: every artifact re-hashed, within a budget
    rebuild.py                     `reg catalog rebuild`: rows from manifests, then the journal
    admin.py                       `reg storage init`, the audit log's commands
    policy_admin.py, token_admin.py, fact_signing.py   policies, tokens, `reg catalog sign`
"""
