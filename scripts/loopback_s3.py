"""A real S3 endpoint for the benchmarks: moto's server on 127.0.0.1 with dummy credentials, set in
the environment so s3fs (and DCP's fsspec storage) reach it. The tests use tests/s3.py instead."""

from __future__ import annotations

import logging
import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3() -> object:
    """Start the server (stop it with `.stop()`); AWS_* variables point at it from here on."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    return server
