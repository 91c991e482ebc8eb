"""A real S3 endpoint for tests: moto's server on 127.0.0.1, reached over HTTP through s3fs exactly
as a user's bucket would be (endpoint and credentials from the standard AWS environment variables,
which child processes inherit)."""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture(scope="session")
def s3_endpoint():
    from conftest import free_port
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


SECRET = "s3cr3t-never-printed"  # the secret key in unreachable_env: no output may contain it


def unreachable_env() -> dict[str, str]:
    """A child environment whose S3 endpoint nobody listens on (a closed loopback port), with dummy
    credentials and no retries, so that a client fails at once."""
    from conftest import child_env, free_port

    return {**child_env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "AKIDTEST",
            "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_MAX_ATTEMPTS": "1", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    """A fresh, empty bucket; returns its URL (s3://name)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    name = f"rekindle-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return f"s3://{name}"
