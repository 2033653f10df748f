"""Push and pull of a >= 1 GiB checkpoint through the S3 store, against boto3's own transfer
(`upload_file` / `download_file`, default TransferConfig) of the same files, in the same run.

    python -m bench.s3 [--gib 1.2] [--repeat 3] [--server seaweedfs|moto|both]

Against each S3 server in its own process on 127.0.0.1: SeaweedFS (a real S3 server, the tests'
default) and moto (an emulator, CPU-bound: about 100 MB per server CPU-second on these
machines). The server shares the 2 cores with the client, so the report also gives client CPU
seconds per GB, which is what scales against real S3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from bench.checkpoints import make_checkpoint
from bench.common import PY, REG, ROOT, dir_bytes, env, measured, rm, settle

BOTO_UPLOAD = """
import sys, boto3
from pathlib import Path
src, bucket, prefix = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
s3 = boto3.client("s3")
for f in sorted(src.iterdir()):
    s3.upload_file(str(f), bucket, f"{prefix}/{f.name}")
"""
BOTO_DOWNLOAD = """
import sys, boto3
from pathlib import Path
dest, bucket, prefix = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
dest.mkdir()
s3 = boto3.client("s3")
for obj in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]:
    s3.download_file(bucket, obj["Key"], str(dest / obj["Key"].rsplit("/", 1)[1]))
"""


def timed(cmd: list[str], environ: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, client CPU seconds) of one command."""
    wall, usage, _ = measured(cmd, environ)
    return wall, usage.ru_utime + usage.ru_stime


def moto_process() -> tuple[subprocess.Popen[bytes], int]:
    """moto in its own process (session) on 127.0.0.1, so its CPU is not the client's."""
    port = 5500 + os.getpid() % 400
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc, port


SERVERS = ("seaweedfs", "moto")


@contextlib.contextmanager
def s3_server(kind: str, work: Path) -> Iterator[dict[str, str]]:
    """An S3 server of `kind` in its own process on 127.0.0.1: the AWS_* settings that reach it."""
    if kind == "seaweedfs":
        from tests.s3server import SeaweedServer

        weed = SeaweedServer(work / "seaweed").start()
        try:
            yield weed.credentials()
        finally:
            weed.stop()
        return
    proc, port = moto_process()
    try:
        time.sleep(2)
        yield {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def servers_of(choice: str) -> tuple[str, ...]:
    return SERVERS if choice == "both" else (choice,)


def report_vs_boto3(
    rows: dict[str, list[tuple[float, float]]], size: int, labels: tuple[str, str]
) -> None:
    """One JSON line per direction: medians of wall time and client CPU s/GB, reg vs boto3."""
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in rows.items()
    }
    gb = size / 1e9
    pairs = (("reg_up", "boto_up"), ("reg_down", "boto_down"))
    for (ours, theirs), label in zip(pairs, labels, strict=True):
        (w, c), (bw, bc) = med[ours], med[theirs]
        row = {
            "what": label,
            "reg_s": round(w, 2),
            "boto3_s": round(bw, 2),
            "ratio": round(bw / w, 2),
            "reg_client_cpu_s_per_gb": round(c / gb, 2),
            "boto3_client_cpu_s_per_gb": round(bc / gb, 2),
        }
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--server", choices=(*SERVERS, "both"), default="both")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="reg-bench-", dir=ROOT / "bench"))
    src = make_checkpoint(work / "src", args.gib)
    size = dir_bytes(src)
    try:
        for kind in servers_of(args.server):
            with s3_server(kind, work) as aws:
                rows = _rows(src, work, aws, args.repeat)
            print(
                f"checkpoint {size / 2**30:.2f} GiB, {kind} in its own process, median of "
                f"{args.repeat}"
            )
            report_vs_boto3(rows, size, ("push vs upload_file", "pull vs download_file"))
    finally:
        if args.work is None:
            rm(work)


Rows = dict[str, list[tuple[float, float]]]
Command = tuple[list[str], dict[str, str]]  # argv, environment


def new_rows() -> Rows:
    return {k: [] for k in ("boto_up", "reg_up", "boto_down", "reg_down")}


def one_round(
    rows: Rows, *, boto_up: Command, reg_up: Command, boto_down: Command, reg_down: Command
) -> None:
    """One upload and one download each way, in this order, each after the page cache settled."""
    for name, (cmd, environ) in (
        ("boto_up", boto_up),
        ("reg_up", reg_up),
        ("boto_down", boto_down),
        ("reg_down", reg_down),
    ):
        settle()
        rows[name].append(timed(cmd, environ))


def _rows(src: Path, work: Path, aws: dict[str, str], repeat: int) -> Rows:
    import boto3

    os.environ.update(aws)
    s3 = boto3.client("s3")
    rows = new_rows()
    for i in range(repeat):
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        s3.create_bucket(Bucket=bucket)
        home = work / f"s3home-{i}"
        e = env(home, REG_STORE_URL=f"s3://{bucket}/reg", **aws)
        one_round(
            rows,
            boto_up=([PY, "-c", BOTO_UPLOAD, str(src), bucket, "plain"], e),
            reg_up=([*REG, "push-ckpt", str(src), "--run", "b", "--step", "1", "--json"], e),
            boto_down=([PY, "-c", BOTO_DOWNLOAD, str(work / f"bd{i}"), bucket, "plain"], e),
            reg_down=([*REG, "pull", "b@step1", str(work / f"rd{i}"), "--json"], e),
        )
        for d in (work / f"bd{i}", work / f"rd{i}", home):
            rm(d)
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=obj["Key"])
    return rows


if __name__ == "__main__":
    main()
