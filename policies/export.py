"""Render the access grants as an S3 bucket policy (storage-level enforcement, DESIGN §6).

The registry's own checks stop mistakes and unauthorized use through the tool; someone holding
the bucket credentials bypasses them. The exported policy closes that at the storage layer:
writes only under `ckpt/<project>/` for trainers of that project, reads as granted, no delete or
unconditional overwrite under `release/` for anyone but admins, and the audit chain's anchors
under `audit/` write-once for everyone (admins included: an anchor is evidence against whoever
holds the database, and the server writes each with If-None-Match). The decision journal under
`journal/` (registry.journal) is the same: written once, by whoever may make a decision (trainers
and up; the server, behind `reg server`), and never deleted, since a rebuild of the catalog
replays it. It stays writable by trainers and up, not admins alone: in embedded mode each client
journals its own decisions, so an admin-only journal would refuse every trainer's pin and
validation and every releaser's alias move, deprecation and promotion that validates. The cost,
stated in docs/concepts/security.md: an unkeyed rebuild trusts every writer of `journal/`
(into a lost catalog only); a deployment that does not trust its store writers runs
`reg server`, which signs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from policies.access import gives, is_scoped_admin
from policies.loader import AccessPolicy, Grant


def bucket_policy(
    access: AccessPolicy,
    bucket: str,
    prefix: str = "",
    owners: Mapping[str, str | None] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """(policy document, principals left out because they have no ARN). `owners` (model ->
    the project that owns it) places the models of a grant that leaves `models` out: a bucket
    policy cannot follow ownership, so it lists the models owned today (export again after a
    new model's first release)."""
    base = f"arn:aws:s3:::{bucket}/{prefix.strip('/') + '/' if prefix.strip('/') else ''}"
    statements: list[dict[str, Any]] = []
    missing: list[str] = []
    admins: set[str] = set()
    non_admins: set[str] = set()
    for n, grant in enumerate(access.grants):
        if is_scoped_admin(grant):  # grants nothing (policies.access)
            continue
        arns = []
        for p in grant.principals:
            arn = access.aws.get(p)
            if arn is None:
                missing.append(p)
            else:
                arns.append(arn)
        if not arns:
            continue
        (admins if grant.role == "admin" else non_admins).update(arns)
        who = {"AWS": sorted(arns)}
        projects = [f"{base}ckpt/{g}/*" for g in grant.projects]
        models = [f"{base}release/{g}/*" for g in _model_globs(grant, owners or {})]
        if grant.role == "admin":
            statements.append(
                {
                    "Sid": f"Grant{n}Admin",
                    "Effect": "Allow",
                    "Principal": who,
                    "Action": "s3:*",
                    "Resource": [f"arn:aws:s3:::{bucket}", f"{base}*"],
                }
            )
            continue
        statements.append(
            {
                "Sid": f"Grant{n}Read",
                "Effect": "Allow",
                "Principal": who,
                "Action": ["s3:GetObject", "s3:GetObjectVersion"],
                "Resource": projects + models,
            }
        )
        statements.append(
            {
                "Sid": f"Grant{n}List",
                "Effect": "Allow",
                "Principal": who,
                "Action": "s3:ListBucket",
                "Resource": f"arn:aws:s3:::{bucket}",
            }
        )
        if gives(grant.role, "trainer"):
            statements.append(
                {
                    "Sid": f"Grant{n}WriteCheckpoints",
                    "Effect": "Allow",
                    "Principal": who,
                    "Action": ["s3:PutObject", "s3:AbortMultipartUpload"],
                    "Resource": projects,
                }
            )
        if gives(grant.role, "trainer"):  # pins, validations, aliases, deprecations
            statements.append(
                {
                    "Sid": f"Grant{n}WriteJournal",
                    "Effect": "Allow",
                    "Principal": who,
                    "Action": "s3:PutObject",
                    "Resource": f"{base}journal/*",
                }
            )
        if gives(grant.role, "releaser"):
            statements.append(
                {
                    "Sid": f"Grant{n}WriteReleases",
                    "Effect": "Allow",
                    "Principal": who,
                    "Action": ["s3:PutObject", "s3:PutObjectRetention"],
                    "Resource": models,
                }
            )
    if non_admins:
        statements.append(
            {
                "Sid": "NoReleaseDeletes",
                "Effect": "Deny",
                "Principal": {"AWS": sorted(non_admins)},
                "Action": [
                    "s3:DeleteObject",
                    "s3:DeleteObjectVersion",
                    "s3:BypassGovernanceRetention",
                ],
                "Resource": f"{base}release/*",
            }
        )
    statements.append(
        {
            "Sid": "ReleaseWritesMustNotOverwrite",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:PutObject",
            "Resource": f"{base}release/*",
            "Condition": {"Null": {"s3:if-none-match": "true"}},
        }
    )
    statements.append(
        {
            "Sid": "AuditAnchorsAreNeverDeleted",
            "Effect": "Deny",
            "Principal": "*",
            "Action": [
                "s3:DeleteObject",
                "s3:DeleteObjectVersion",
                "s3:BypassGovernanceRetention",
                "s3:PutObjectRetention",
            ],
            "Resource": f"{base}audit/*",
        }
    )
    statements.append(
        {
            "Sid": "AuditAnchorsAreWriteOnce",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:PutObject",
            "Resource": f"{base}audit/*",
            "Condition": {"Null": {"s3:if-none-match": "true"}},
        }
    )
    statements.append(
        {
            "Sid": "JournalIsNeverDeleted",
            "Effect": "Deny",
            "Principal": "*",
            "Action": ["s3:DeleteObject", "s3:DeleteObjectVersion"],
            "Resource": f"{base}journal/*",
        }
    )
    statements.append(
        {
            "Sid": "JournalWritesAreWriteOnce",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:PutObject",
            "Resource": f"{base}journal/*",
            "Condition": {"Null": {"s3:if-none-match": "true"}},
        }
    )
    return {"Version": "2012-10-17", "Statement": statements}, sorted(set(missing))


def _model_globs(grant: Grant, owners: Mapping[str, str | None]) -> list[str]:
    """The model globs a grant covers: its own list, else the models its projects own."""
    if grant.models is not None:
        return grant.models
    if grant.projects == ["*"]:
        return ["*"]
    return sorted(
        model
        for model, owner in owners.items()
        if owner is not None and any(fnmatch.fnmatchcase(owner, g) for g in grant.projects)
    )
