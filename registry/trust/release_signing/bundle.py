"""A release's `model.sig` in the OpenSSF model-signing format (v1.1.1's key mode), built from
the digests the promotion already computed (no second read of the weights), and checked the
same way without reading the files again where their digests are known.

The signature is a Sigstore bundle whose DSSE envelope carries an in-toto statement: one
resource per file of the release folder (path and sha256) and a subject digest over them,
serialized as model-signing's `files` method with `model.sig` and git's files ignored, exactly
what `model_signing sign key DIR` records. `model_signing verify key DIR --signature
DIR/model.sig --public_key KEY.pem` therefore checks a pulled release with no reg code.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import pathlib
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from registry.core.layout import RELEASE_DOCUMENT
from registry.errors import IntegrityError

SIGNATURE_FILE = "model.sig"  # model-signing's default name
CURVES = ("secp256r1", "secp384r1", "secp521r1")  # model-signing's key mode
MAX_SIGNATURE = 16 * 1024 * 1024  # a bundle is a few KiB, plus one line per signed file
# What `model_signing sign` records as ignored: its signature, and git's files.
IGNORED = (SIGNATURE_FILE, ".git", ".gitattributes", ".github", ".gitignore")


def sign(private_key: Path, model_name: str, digests: Mapping[str, str]) -> bytes:
    """The bytes of `model.sig` over `digests` (path in the release -> sha256 hex)."""
    from model_signing import manifest
    from model_signing._hashing import hashing
    from model_signing._signing import sign_ec_key, signing

    serialization = manifest._FileSerialization(
        "sha256", allow_symlinks=False, ignore_paths=[pathlib.Path(p) for p in IGNORED]
    )
    items = [
        manifest.FileManifestItem(
            path=pathlib.PurePosixPath(path),
            digest=hashing.Digest("sha256", bytes.fromhex(digest)),
        )
        for path, digest in sorted(digests.items())
    ]
    payload = signing.Payload(manifest.Manifest(model_name, items, serialization))
    try:
        signature = sign_ec_key.Signer(private_key).sign(payload)
    except (ValueError, TypeError) as exc:  # not a PEM, encrypted, another curve
        raise IntegrityError(
            f"the signing key {private_key.name} cannot sign: {_one_line(exc)}",
            "reg keys rotate makes a new one",
        ) from None
    with tempfile.TemporaryDirectory(prefix="reg-sig-") as tmp:
        out = Path(tmp) / SIGNATURE_FILE
        signature.write(out)
        return out.read_bytes()


def signed_digests(signature: bytes, public_pem: str) -> dict[str, str]:
    """Check `signature` (the bytes of a model.sig) against `public_pem`: the files and sha256
    digests it covers. IntegrityError if it is not a valid signature by that key."""
    from model_signing._signing import sign_ec_key, sign_sigstore_pb

    with tempfile.TemporaryDirectory(prefix="reg-sig-") as tmp:
        sig_path, key_path = Path(tmp) / SIGNATURE_FILE, Path(tmp) / "key.pem"
        sig_path.write_bytes(signature)
        key_path.write_text(public_pem)
        try:
            # the library prints warnings (a bundle without a key hint) to stdout: never into
            # a command's --json
            with contextlib.redirect_stdout(io.StringIO()):
                parsed = sign_sigstore_pb.Signature.read(sig_path)
                expected = sign_ec_key.Verifier(key_path).verify(parsed)
        except Exception as exc:  # the library raises ValueError and its own errors
            raise IntegrityError(
                f"{SIGNATURE_FILE} is not a valid signature by this key: {_one_line(exc)}",
                "the release was altered, or signed by another key",
            ) from None
    serialization = expected.serialization_type
    if serialization.get("method") != "files" or serialization.get("hash_type") != "sha256":
        raise IntegrityError(f"{SIGNATURE_FILE} does not cover whole files by sha256")
    return {rd.identifier: rd.digest.digest_hex for rd in expected.resource_descriptors()}


def claimed_digests(signature: bytes) -> dict[str, str]:
    """The files and sha256 digests `signature` (a model.sig's bytes) says it covers, read
    WITHOUT checking the signature: what a folder checked without a pinned key can compare its
    files to (consistency, not authenticity). IntegrityError if it does not read as one."""
    try:
        envelope = json.loads(signature)["dsseEnvelope"]
        statement = json.loads(base64.b64decode(envelope["payload"], validate=True))
        resources = statement["predicate"]["resources"]
        return {
            str(r["name"]): str(r["digest"]) for r in resources if r.get("algorithm") == "sha256"
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        raise IntegrityError(
            f"{SIGNATURE_FILE} does not read as a model-signing signature",
            "pull the release again",
        ) from None


def check_folder(signature: bytes, public_pem: str, folder: Mapping[str, str]) -> None:
    """`folder` (every file of a release folder but model.sig -> its sha256) is exactly what
    `signature` covers, signed by `public_pem`: the check `model_signing verify` makes, from
    digests already computed."""
    signed = signed_digests(signature, public_pem)
    problems = _differences(signed, folder)
    if problems:
        raise IntegrityError(
            f"the release does not match its signature: {problems}",
            "pull it again; if it persists, the release was altered",
        )


def _differences(signed: Mapping[str, str], found: Mapping[str, str]) -> str:
    extra = sorted(set(found) - set(signed))
    missing = sorted(set(signed) - set(found))
    changed = sorted(p for p in set(signed) & set(found) if signed[p] != found[p])
    parts = []
    for label, paths in (("not signed", extra), ("missing", missing), ("changed", changed)):
        if paths:
            parts.append(f"{label}: {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}")
    return "; ".join(parts)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def check_pulled(
    folder: Path,
    files: Iterable[tuple[str, str]],
    public_pem: str,
    model: str,
    version: int | None,
) -> None:
    """A release folder about to be handed over (`files`: each file written into it and its
    sha256, as checked while writing) is signed by `public_pem` (a key the consumer pinned)
    over exactly those files, and its release.json (covered by the signature) is the release
    asked for: `model`, and `version` where the ref named one. IntegrityError otherwise."""
    written = dict(files)
    label = f"{model}:v{version}" if version is not None else model
    if SIGNATURE_FILE not in written:
        raise IntegrityError(
            f"{label} is not signed", "promote it again where a signing key is active"
        )
    signature = (folder / SIGNATURE_FILE).read_bytes()
    check_folder(signature, public_pem, {p: d for p, d in written.items() if p != SIGNATURE_FILE})
    try:
        document = json.loads((folder / RELEASE_DOCUMENT).read_bytes())
        named = (document["model"], int(document["version"]))
    except (OSError, ValueError, KeyError, TypeError):
        raise IntegrityError(f"the signed {RELEASE_DOCUMENT} of {label} is not readable") from None
    if named[0] != model or (version is not None and named[1] != version):
        raise IntegrityError(
            f"the signed release is {named[0]}:v{named[1]}, not {label}",
            "the registry answered with another release's files; do not serve them",
        )


def read_public_key(path: Path) -> str:
    """A pinned PEM public key (ECDSA, the curves model-signing takes), checked on reading."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        text = path.read_text()
        key = load_pem_public_key(text.encode())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(
            f"{path} is not a PEM public key: {_one_line(exc)}",
            "reg keys public prints the registry's (pin that file)",
        ) from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in CURVES:
        raise IntegrityError(
            f"{path} is not an ECDSA key on {', '.join(CURVES)} (what model-signing takes)",
            "pin reg keys public's output",
        )
    return text
