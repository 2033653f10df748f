"""`reg server` on S3: a presigned push and pull (the client moves the bytes straight to S3 with
URLs the server signed) against boto3's `upload_file` / `download_file` of the same files to the
same S3 server, in the same run.

    python -m bench.presigned [--gib 1.2] [--repeat 3] [--server seaweedfs|moto|both]

The S3 server (SeaweedFS, a real one, and moto, a CPU-bound emulator) runs in its own process and
`reg server` in another, both on 127.0.0.1; this 2-core machine runs all three, so wall time is
partly the server's. Client CPU seconds per GB (the client process alone, from wait4) is what
carries over to real S3.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import uuid
from pathlib import Path

from bench.checkpoints import make_checkpoint
from bench.common import PY, REG, ROOT, dir_bytes, env, rm
from bench.s3 import (
    BOTO_DOWNLOAD,
    BOTO_UPLOAD,
    SERVERS,
    Rows,
    new_rows,
    one_round,
    report_vs_boto3,
    s3_server,
    servers_of,
)


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
                rows = _rows(src, work / kind, aws, args.repeat)
            print(
                f"checkpoint {size / 2**30:.2f} GiB; {kind} and reg server in their own "
                f"processes; median of {args.repeat}"
            )
            labels = ("presigned push vs upload_file", "presigned pull vs download_file")
            report_vs_boto3(rows, size, labels)
    finally:
        if args.work is None:
            rm(work)


def _rows(src: Path, work: Path, aws: dict[str, str], repeat: int) -> Rows:
    import boto3

    from tests.serverproc import RegServer, server_env

    os.environ.update(aws)
    s3 = boto3.client("s3")
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=bucket)
    home = work / "server-home"
    senv = server_env(home, f"sqlite:///{home / 'catalog.db'}", f"s3://{bucket}/reg")
    server = RegServer({**senv, **aws}, home).init().start()
    try:
        client = env(work / "client-home", REG_URL=server.url, REG_TOKEN=server.admin_token)
        boto = env(work / "boto-home", **aws)
        rows = new_rows()
        for i in range(repeat):
            one_round(
                rows,
                boto_up=([PY, "-c", BOTO_UPLOAD, str(src), bucket, f"p{i}"], boto),
                reg_up=([*REG, "push-ckpt", str(src), "--run", "b", "--step", str(i)], client),
                boto_down=([PY, "-c", BOTO_DOWNLOAD, str(work / f"bd{i}"), bucket, f"p{i}"], boto),
                reg_down=([*REG, "pull", f"b@step{i}", str(work / f"rd{i}")], client),
            )
            for d in (work / f"bd{i}", work / f"rd{i}"):
                rm(d)
        return rows
    finally:
        server.stop()


if __name__ == "__main__":
    main()
