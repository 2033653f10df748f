"""`reg server` on S3: a presigned push and pull (the client moves the bytes straight to S3 with
URLs the server signed) against boto3's `upload_file` / `download_file` of the same files to the
same S3 server, in the same run.

    python -m bench.presigned [--gib 1.2] [--repeat 3]

moto runs in its own process and `reg server` in another, both on 127.0.0.1; this 2-core machine
runs all three, and moto is CPU-bound, so wall time is mostly moto's. Client CPU seconds per GB
(the client process alone, from wait4) is what carries over to real S3.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from pathlib import Path

from bench.checkpoints import make_checkpoint
from bench.common import PY, REG, ROOT, dir_bytes, env, rm, settle
from bench.s3 import BOTO_DOWNLOAD, BOTO_UPLOAD, moto_process, report_vs_boto3, timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="reg-bench-", dir=ROOT / "bench"))
    src = make_checkpoint(work / "src", args.gib)
    size = dir_bytes(src)
    moto, port = moto_process()
    server = None
    try:
        time.sleep(2)
        import boto3

        from tests.serverproc import RegServer, server_env

        aws = {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }
        os.environ.update(aws)
        s3 = boto3.client("s3")
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        s3.create_bucket(Bucket=bucket)
        home = work / "server-home"
        senv = server_env(home, f"sqlite:///{home / 'catalog.db'}", f"s3://{bucket}/reg")
        server = RegServer({**senv, **aws}, home).init().start()
        client = env(work / "client-home", REG_URL=server.url, REG_TOKEN=server.admin_token)
        boto = env(work / "boto-home", **aws)
        rows: dict[str, list[tuple[float, float]]] = {
            k: [] for k in ("boto_up", "reg_up", "boto_down", "reg_down")
        }
        for i in range(args.repeat):
            settle()
            rows["boto_up"].append(timed([PY, "-c", BOTO_UPLOAD, str(src), bucket, f"p{i}"], boto))
            settle()
            rows["reg_up"].append(
                timed([*REG, "push-ckpt", str(src), "--run", "b", "--step", str(i)], client)
            )
            settle()
            rows["boto_down"].append(
                timed([PY, "-c", BOTO_DOWNLOAD, str(work / f"bd{i}"), bucket, f"p{i}"], boto)
            )
            settle()
            rows["reg_down"].append(
                timed([*REG, "pull", f"b@step{i}", str(work / f"rd{i}")], client)
            )
            for d in (work / f"bd{i}", work / f"rd{i}"):
                rm(d)
        print(
            f"checkpoint {size / 2**30:.2f} GiB; moto and reg server in their own processes; "
            f"median of {args.repeat}"
        )
        labels = ("presigned push vs upload_file", "presigned pull vs download_file")
        report_vs_boto3(rows, size, labels)
    finally:
        if server is not None:
            server.stop()
        os.killpg(moto.pid, 9)
        moto.wait()
        if args.work is None:
            rm(work)


if __name__ == "__main__":
    main()
