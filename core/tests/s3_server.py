"""A real S3 API server on 127.0.0.1 for the object-store checkpoint tests and benchmarks (moto's server mode).

Clients find it through the standard AWS environment, which worker processes inherit::

    AWS_ENDPOINT_URL=http://127.0.0.1:PORT AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing
    AWS_DEFAULT_REGION=us-east-1

(botocore, hence s3fs, reads ``AWS_ENDPOINT_URL``). ``python s3_server.py [--auth]`` runs one in the
foreground; ``--auth`` makes it check credentials (every request with unknown keys is refused).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from typing import Any

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environment(endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, **CREDENTIALS}


class S3Server:
    """``moto_server`` in a child process (so that clients in this process do not share its interpreter)."""

    def __init__(self, auth: bool = False) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # moto then checks every request's credentials
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not start on port {self.port}") from None
                time.sleep(0.1)

    def env(self) -> dict[str, str]:
        return environment(self.endpoint)

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, **_boto_credentials()).create_bucket(Bucket=name)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--auth", action="store_true")
    parser.add_argument("--bucket", action="append", default=[])
    args = parser.parse_args()
    with S3Server(auth=args.auth) as server:
        for bucket in args.bucket:
            server.create_bucket(bucket)
        print(" ".join(f"{k}={v}" for k, v in server.env().items()), flush=True)
        server.process.wait()
