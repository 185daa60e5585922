"""The gateway's command-line options, shared by `k3backend openai` and `k3backend serve --openai`.

Only the standard library here: the launcher (k3backend.tritonserver) imports it before anything
heavy, and a `serve` without `--openai` must stay as cheap as before.
"""

from __future__ import annotations

import argparse
import os

API_KEY_ENV = "K3_OPENAI_API_KEY"  # how the launcher hands the key over without showing it in `ps`


def add_options(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """Add the options; `serve` passes prefix "openai-" for the host and port (tritonserver has its own)."""
    p.add_argument(f"--{prefix}host", default="127.0.0.1", help="address the gateway listens on (default %(default)s)")
    p.add_argument(f"--{prefix}port", type=int, default=9000, help="the gateway's port (default %(default)s)")
    p.add_argument("--served-model-name", default="k3", help="the model name clients send (default %(default)s)")
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, "
                                     "else no key)")
    p.add_argument("--triton-model", default="k3_ensemble", help="the Triton model to call (default %(default)s)")
    p.add_argument("--text-model", default="k3_lm",
                   help="the Triton model for requests without images, '' for --triton-model (default %(default)s: "
                        "the ensemble's first step, k3_vision, has nothing to do for them but adds a hop)")
    p.add_argument("--max-request-bytes", type=int, default=64 * 2**20,
                   help="larger request bodies get 413 (default %(default)s, room for base64 images)")
    p.add_argument("--grpc-channels", type=int, default=1, help="gRPC channels to Triton per process "
                                                               "(default %(default)s)")
    p.add_argument("--workers", type=int, default=0,
                   help="gateway processes sharing the port (SO_REUSEPORT), each taking whole connections; "
                        "one process handles a few thousand streamed tokens per second (default 0: one per 4 "
                        "CPUs, at most 4)")


def gateway_argv(args: argparse.Namespace, triton_url: str, prefix: str = "") -> list[str]:
    """`k3backend openai` arguments for the parsed options (the API key is not among them)."""
    get = lambda name: getattr(args, (prefix + name).replace("-", "_"))  # noqa: E731
    return ["--triton-url", triton_url, "--host", get("host"), "--port", str(get("port")),
            "--served-model-name", args.served_model_name, "--triton-model", args.triton_model,
            "--text-model", args.text_model,
            "--max-request-bytes", str(args.max_request_bytes), "--grpc-channels", str(args.grpc_channels),
            "--workers", str(args.workers)]


def workers(requested: int) -> int:
    """--workers, 0 resolved: one process per 4 CPUs, at most 4. On a 16-core H200 host 4 processes put the
    gateway's TTFT cost at concurrency 64 at about 1 ms, one process at about 3 (docs/openai.md "Overhead");
    a small machine keeps one, leaving its cores to tritonserver."""
    if requested < 0:
        raise SystemExit(f"--workers must be 0 (one per 4 CPUs, at most 4) or a number of processes, got {requested}")
    return requested or max(1, min(4, (os.cpu_count() or 1) // 4))


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or None
