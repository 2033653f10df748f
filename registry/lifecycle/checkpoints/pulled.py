"""A pulled folder keeps the document it was pulled with: a checkpoint its MANIFEST.json, a
release its release.json, byte for byte as the store holds them (the catalog records each one's
sha256: `manifest_sha256`, a release's `sha256`). Either lists every file with its size and
sha256, so the folder can be checked offline, with no catalog or store:

    verify_folder    every listed file there with its size and sha256, nothing else there (but
                     a release's model.sig, and the statement and card `reg sign-release`
                     added, each what model.sig says it signs), the document well formed (a
                     manifest's `bytes` the sum of its sizes), and with `expect_sha256` the
                     document itself the one the registry recorded
    KeptManifest     pushing a pulled checkpoint folder again (a fork, a migration): the kept
                     MANIFEST.json is not a checkpoint file; the folder's file set and sizes
                     must be the manifest's before anything is copied, and each file's sha256
                     (hashed by the copy itself) before the new step's manifest is written
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.core.layout import MANIFEST, RELEASE_DOCUMENT
from registry.errors import IntegrityError, InvalidDocument, UsageError
from registry.formats.documents import FileRecord, Manifest, ReleaseDocument
from registry.trust.release_signing.bundle import (
    MAX_SIGNATURE,
    SIGNATURE_FILE,
    check_folder,
    claimed_digests,
)
from registry.trust.release_signing.provenance import CARD_FILE, PROVENANCE_FILE

HASH_WORKERS = 4  # hashlib releases the GIL: files hash in parallel
# A kept MANIFEST.json or release.json larger than this is not read: reg writes about 200 bytes
# per file, so this is some 300,000 files (`reg server` takes at most 100,000).
MAX_KEPT = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Kept:
    """The document a pulled folder keeps."""

    name: str  # MANIFEST.json or release.json
    kind: str  # checkpoint or release
    ref: str
    sha256: str
    files: tuple[FileRecord, ...]


def read_kept(root: Path) -> Kept:
    """The folder's MANIFEST.json or release.json, parsed strictly (InvalidDocument, exit 1, for
    one that does not read: a damaged or edited document)."""
    root = Path(root)
    if not root.is_dir() or root.is_symlink():
        raise UsageError(f"{root} is not a directory", "give the folder `reg pull` made")
    present = [n for n in (MANIFEST, RELEASE_DOCUMENT) if (root / n).is_file()]
    if not present:
        raise UsageError(
            f"{root} holds neither {MANIFEST} nor {RELEASE_DOCUMENT}: not a folder reg pulled",
            "pull it again (reg pull REF DIR, reg pull-release REF DIR), or check it online with "
            "reg verify REF",
        )
    if len(present) > 1:
        raise UsageError(
            f"{root} holds both {MANIFEST} and {RELEASE_DOCUMENT}",
            "a pulled folder is one checkpoint or one release",
        )
    name = present[0]
    data = _read_capped(root / name)
    digest = hashlib.sha256(data).hexdigest()
    where = f"{root / name}"
    if name == MANIFEST:
        manifest = Manifest.from_bytes(data, where)
        return Kept(name, "checkpoint", str(manifest.ref), digest, manifest.files)
    release = ReleaseDocument.from_bytes(data, where)
    return Kept(name, "release", release.release, digest, release.files)


def _read_capped(path: Path) -> bytes:
    """The document's bytes, refused (InvalidDocument) past MAX_KEPT: checked before reading
    and while reading, so a huge or growing file is never read whole into memory."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(MAX_KEPT + 1) if size <= MAX_KEPT else b""
    if size > MAX_KEPT or len(data) > MAX_KEPT:
        raise InvalidDocument(
            f"{path} is {max(size, len(data))} bytes, over {MAX_KEPT}: not a document reg wrote",
            "pull the folder again, or check it online with reg verify REF",
        )
    return data


@dataclass(slots=True)
class FolderReport:
    root: Path
    kept: Kept
    expected_sha256: str | None
    problems: list[dict[str, str]] = field(default_factory=list)
    # files `reg sign-release` added beside the listed ones (path -> sha256, as hashed here)
    signed_later: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "dir": str(self.root),
            "kind": self.kept.kind,
            "ref" if self.kept.kind == "checkpoint" else "release": self.kept.ref,
            "document": self.kept.name,
            "document_sha256": self.kept.sha256,
            "expected_sha256": self.expected_sha256,
            "ok": self.ok,
            "files": len(self.kept.files),
            "bytes": sum(f.size for f in self.kept.files),
            "problems": self.problems,
            **({"signed_later": sorted(self.signed_later)} if self.signed_later else {}),
        }


def verify_folder(
    root: Path, *, expect_sha256: str | None = None, public_key: str | None = None
) -> FolderReport:
    """Check a pulled folder offline against the document it keeps (see the module); with
    `public_key` (a pinned PEM) a release folder's model.sig must also sign exactly it."""
    root = Path(root).absolute()
    kept = read_kept(root)
    report = FolderReport(root, kept, expect_sha256)
    _check_folder(root, kept, report)
    if public_key is not None and not report.problems:
        _check_signature(root, kept, report, public_key)
    return report


def _check_signature(root: Path, kept: Kept, report: FolderReport, public_key: str) -> None:
    """The files just verified against release.json, and release.json itself, are exactly
    what model.sig signs under `public_key`."""
    if kept.kind != "release":
        report.problems.append({"path": kept.name, "problem": "a checkpoint is not signed"})
        return
    covered = {f.path: f.sha256 for f in kept.files} | report.signed_later
    covered[kept.name] = kept.sha256
    signature = _read_signature(root, report)
    if signature is None:
        return
    try:
        check_folder(signature, public_key, covered)
    except IntegrityError as exc:
        report.problems.append({"path": SIGNATURE_FILE, "problem": str(exc)})


def _read_signature(root: Path, report: FolderReport) -> bytes | None:
    try:
        with open(root / SIGNATURE_FILE, "rb") as f:
            signature = f.read(MAX_SIGNATURE + 1)
    except OSError as exc:
        report.problems.append({"path": SIGNATURE_FILE, "problem": exc.strerror or str(exc)})
        return None
    if len(signature) > MAX_SIGNATURE:
        report.problems.append({"path": SIGNATURE_FILE, "problem": "too large to be a signature"})
        return None
    return signature


def _signed_later(root: Path, present: dict[str, int], report: FolderReport) -> set[str]:
    """The provenance statement and card `reg sign-release` added to a release committed
    without them (its release.json cannot list them): each must be what model.sig says it
    signed. Read here without a key (consistency); `--public-key` then checks the signature
    over them too. The paths accounted for."""
    listed = {f.path for f in report.kept.files}
    later = sorted({PROVENANCE_FILE, CARD_FILE} & (set(present) - listed))
    if not later or SIGNATURE_FILE not in present:
        return set()
    signature = _read_signature(root, report)
    if signature is None:
        return set(later)
    try:
        claimed = claimed_digests(signature)
    except IntegrityError as exc:
        report.problems.append({"path": SIGNATURE_FILE, "problem": str(exc)})
        return set(later)
    records = [FileRecord(p, present[p], claimed.get(p, "")) for p in later]
    for record, got in zip(records, hash_all(root, records), strict=True):
        if got != record.sha256:
            report.problems.append(
                {"path": record.path, "problem": f"sha256 {got[:12]}..., not what model.sig signs"}
            )
        else:
            report.signed_later[record.path] = got
    return set(later)


def _check_folder(root: Path, kept: Kept, report: FolderReport) -> None:
    expect_sha256 = report.expected_sha256
    if expect_sha256 is not None and expect_sha256 != kept.sha256:
        report.problems.append(
            {
                "path": kept.name,
                "problem": f"sha256 {kept.sha256[:12]}..., the registry recorded "
                f"{expect_sha256[:12]}... (another document: the folder is not that {kept.kind})",
            }
        )
    present, odd = walk(root)
    report.problems.extend({"path": p, "problem": why} for p, why in odd)
    listed = {f.path: f for f in kept.files}
    to_hash = []
    for f in kept.files:
        size = present.get(f.path)
        if size is None:
            report.problems.append({"path": f.path, "problem": "missing"})
        elif size != f.size:
            report.problems.append(
                {"path": f.path, "problem": f"{size} bytes, {kept.name} records {f.size}"}
            )
        else:
            to_hash.append(f)
    for f, got in zip(to_hash, hash_all(root, to_hash), strict=True):
        if got != f.sha256:
            report.problems.append(
                {
                    "path": f.path,
                    "problem": f"sha256 {got[:12]}..., {kept.name} records {f.sha256[:12]}...",
                }
            )
    # A release's signature covers release.json, so release.json cannot list it: it is the
    # release's, checked against a pinned key (`reg pull-release --verify-signature`, or
    # `model_signing verify key`), not here.
    signature = {SIGNATURE_FILE} if kept.kind == "release" else set()
    if kept.kind == "release":
        signature |= _signed_later(root, present, report)
    for path in sorted(set(present) - set(listed) - {kept.name} - signature):
        report.problems.append({"path": path, "problem": f"not listed in {kept.name}"})


def walk(root: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Regular files under `root` (relative path -> size), and what is not one (symlinks,
    devices): those are problems, never followed."""
    files: dict[str, int] = {}
    odd: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                odd.append((rel, "a symlink (a pulled folder holds none)"))
            elif stat.S_ISREG(st.st_mode):
                files[rel] = st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                odd.append((rel, "not a regular file"))
    return files, odd


def hash_all(root: Path, files: list[FileRecord]) -> list[str]:
    """The sha256 of each of `files` under `root` (links followed), HASH_WORKERS at a time."""

    def one(f: FileRecord) -> str:
        with open(root / f.path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()

    with ThreadPoolExecutor(max_workers=HASH_WORKERS) as pool:
        return list(pool.map(one, files))


# -- pushing a pulled checkpoint folder -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeptManifest:
    """The MANIFEST.json a pulled checkpoint folder kept, while the folder is pushed again."""

    root: Path
    kept: Kept

    @classmethod
    def of(cls, root: Path) -> KeptManifest | None:
        """The folder's kept manifest; None when it has no MANIFEST.json. A MANIFEST.json
        that does not read as one refuses the push (exit 1)."""
        if not (Path(root) / MANIFEST).is_file():
            return None
        kept = read_kept(root)
        if kept.kind != "checkpoint":  # both documents: read_kept refused already
            raise UsageError(f"{root} holds {kept.name}, not a checkpoint's {MANIFEST}")
        return cls(Path(root), kept)

    @property
    def skip(self) -> frozenset[str]:
        """What the push leaves out: the kept manifest (the new step writes its own)."""
        return frozenset({MANIFEST})

    def check_files(self, files: dict[str, int]) -> None:
        """The scanned file set and sizes are the manifest's (before anything is copied)."""
        listed = {f.path: f.size for f in self.kept.files}
        problems = [f"{p}: missing" for p in sorted(set(listed) - set(files))]
        problems += [f"{p}: not listed in {MANIFEST}" for p in sorted(set(files) - set(listed))]
        problems += [
            f"{p}: {files[p]} bytes, {MANIFEST} records {listed[p]}"
            for p in sorted(set(files) & set(listed))
            if files[p] != listed[p]
        ]
        self._refuse(problems)

    def check_digests(self, digests: Iterable[tuple[str, str]]) -> None:
        """Each copied file's sha256 (path, digest) is the manifest's: checked before the new
        step's manifest is written, so a changed folder commits nothing."""
        listed = {f.path: f.sha256 for f in self.kept.files}
        self._refuse(
            [
                f"{p}: sha256 {got[:12]}..., {MANIFEST} records {listed[p][:12]}..."
                for p, got in digests
                if listed.get(p) != got
            ]
        )

    def check_folder(self) -> None:
        """Every file hashed against the manifest (a push through `reg server`, whose copy
        the server hashes: checked here before a byte is sent, one more read of the folder)."""
        report = verify_folder(self.root)
        self._refuse([f"{p['path']}: {p['problem']}" for p in report.problems])

    def _refuse(self, problems: list[str]) -> None:
        if problems:
            more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
            raise IntegrityError(
                f"{self.root} was pulled from {self.kept.ref} but no longer matches its "
                f"{MANIFEST}: {problems[0]}{more}; nothing was committed",
                f"reg verify --dir {self.root} lists every problem; to push changed files as "
                f"new content, remove {MANIFEST} from the folder",
            )
