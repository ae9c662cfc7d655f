"""A real S3-compatible server for the tests: moto's server mode in a subprocess on 127.0.0.1.

Authentication is enforced (moto accepts any key by default): an IAM user with an access key
is created first, then ``/moto-api/reset-auth`` turns checking on, so a wrong secret or an
unknown key id is refused as real S3 would refuse it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

BUCKET = "actstore-test"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    env: dict[str, str]  # AWS_* variables with valid credentials
    bucket: str = BUCKET


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("moto server did not start listening in time")


@contextmanager
def moto_server() -> Iterator[S3Server]:
    """Start moto, create a user, its key and a bucket, enforce authentication; stop on exit."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(port, proc)
        base = {
            "aws_access_key_id": "setup",
            "aws_secret_access_key": "setup",
            "region_name": "us-east-1",
            "endpoint_url": endpoint,
        }
        iam = boto3.client("iam", **base)
        iam.create_user(UserName="actstore")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="actstore", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="actstore")["AccessKey"]
        boto3.client("s3", **base).create_bucket(Bucket=BUCKET)
        req = urllib.request.Request(
            f"{endpoint}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(req, timeout=10).read()
        env = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_MAX_ATTEMPTS": "2",  # botocore retries: keep failing cases fast
            "AWS_EC2_METADATA_DISABLED": "true",  # never look for instance credentials off this machine
        }
        yield S3Server(endpoint, env)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def aws_env(server: S3Server, **overrides: str) -> dict[str, str]:
    """``os.environ`` with the server's AWS settings (and ``overrides``), for subprocesses."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env)
    env.update(overrides)
    return env


def use_server_env(monkeypatch: pytest.MonkeyPatch, server: S3Server) -> None:
    """Point this process's AWS settings at ``server`` through ``monkeypatch`` (a pytest MonkeyPatch):
    its variables set, the ones that would redirect or override them removed."""
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
