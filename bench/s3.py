"""Push and pull of a >= 1 GiB checkpoint through the S3 store, against boto3's own transfer
(`upload_file` / `download_file`, default TransferConfig) of the same files, in the same run.

    python -m bench.s3 [--gib 1.2] [--repeat 3]

The server is moto in its own process on 127.0.0.1; moto is CPU-bound (about 100 MB per server
CPU-second on these machines) and is the bottleneck for both sides, so the report also gives
client CPU seconds per GB, which is what scales against real S3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
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
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="reg-bench-", dir=ROOT / "bench"))
    src = make_checkpoint(work / "src", args.gib)
    size = dir_bytes(src)
    server, port = moto_process()
    try:
        time.sleep(2)
        import boto3

        aws = {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }
        os.environ.update(aws)
        s3 = boto3.client("s3")
        rows: dict[str, list[tuple[float, float]]] = {
            k: [] for k in ("boto_up", "reg_up", "boto_down", "reg_down")
        }
        for i in range(args.repeat):
            bucket = f"bench-{uuid.uuid4().hex[:10]}"
            s3.create_bucket(Bucket=bucket)
            home = work / f"s3home-{i}"
            e = env(home, REG_STORE_URL=f"s3://{bucket}/reg", **aws)
            settle()
            rows["boto_up"].append(timed([PY, "-c", BOTO_UPLOAD, str(src), bucket, "plain"], e))
            settle()
            rows["reg_up"].append(
                timed([*REG, "push-ckpt", str(src), "--run", "b", "--step", "1", "--json"], e)
            )
            settle()
            rows["boto_down"].append(
                timed([PY, "-c", BOTO_DOWNLOAD, str(work / f"bd{i}"), bucket, "plain"], e)
            )
            settle()
            rows["reg_down"].append(
                timed([*REG, "pull", "b@step1", str(work / f"rd{i}"), "--json"], e)
            )
            for d in (work / f"bd{i}", work / f"rd{i}", home):
                rm(d)
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                for obj in page.get("Contents", []):
                    s3.delete_object(Bucket=bucket, Key=obj["Key"])
        print(f"checkpoint {size / 2**30:.2f} GiB, moto in its own process, {args.repeat} runs")
        report_vs_boto3(rows, size, ("push vs upload_file", "pull vs download_file"))
    finally:
        os.killpg(server.pid, 9)
        server.wait()
        if args.work is None:
            rm(work)


if __name__ == "__main__":
    main()
