"""`edge0 serve`: flags, the bind-address check, and serving the app (lifecycle.py).

Imports of torch, FastAPI and uvicorn wait until the command runs, so building the CLI's
parser stays fast.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Warn when the server is reachable from other machines without an API key."""
    if not is_loopback(host) and not api_key:
        log.warning(
            "binding %s without --api-key: anyone who can reach this address can use the "
            "model; pass --api-key KEY or bind 127.0.0.1",
            host,
        )


def read_timeouts(args: argparse.Namespace):
    """The read timeouts the flags ask for (0: none; a huge value stands for none)."""
    from edge0.server.http import NO_TIMEOUT, Timeouts

    values = {}
    for flag, name in (
        ("header_timeout", "header_s"),
        ("body_timeout", "body_s"),
        ("keep_alive_timeout", "keep_alive_s"),
    ):
        value = getattr(args, flag)
        if not value >= 0:  # (NaN too)
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 0, got {value}")
        values[name] = value or NO_TIMEOUT
    return Timeouts(**values)


def served_name(ref: Path | None, path: Path) -> str:
    """The id /v1/models lists: the built-in model's name, a repo id as given (vLLM's way,
    without a revision), else the directory's name."""
    from edge0 import builtin, hub

    if ref is None:
        return builtin.NAME
    if hub.is_repo_id(str(ref)):
        return str(ref).partition("@")[0]
    return path.name


def add_serve_parser(sub) -> argparse.ArgumentParser:
    from edge0.cli.args import add_engine_args
    from edge0.util import limits, memory

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    s.add_argument(
        "model_dir",
        type=Path,
        nargs="?",
        default=None,
        help="edge0 model directory (default: the built-in model)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    s.add_argument("--port", type=int, default=8000)
    key = s.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes"
    )
    key.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="read the key from this file's first line (keeps it out of the process list)",
    )
    s.add_argument(
        "--model-name",
        default=None,
        help="the model's id in the API; requests naming another get 404 (default: the "
        "directory's name, edge0-builtin for the built-in model)",
    )
    s.add_argument(
        "--queue-size",
        type=int,
        default=32,
        help="requests that may wait behind the active ones; more get 429 (default 32)",
    )
    s.add_argument(
        "--max-body",
        type=memory.parse_size,
        default=memory.parse_size("1M"),
        help="largest request body accepted (default 1M)",
    )
    s.add_argument(
        "--default-max-tokens",
        type=int,
        default=limits.CHAT_MAX_TOKENS,
        help="most tokens a chat request without max_tokens gets; it then ends with "
        f"finish_reason 'length' (default {limits.CHAT_MAX_TOKENS}; 0: to the end of the context)",
    )
    s.add_argument(
        "--shutdown-grace",
        type=float,
        default=limits.SHUTDOWN_GRACE_S,
        help="seconds the running request gets to finish on SIGTERM or Ctrl-C before it is "
        f"cut with a 'shutting_down' error (default {limits.SHUTDOWN_GRACE_S:g})",
    )
    s.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines as timestamped text, or as one JSON object each (default text)",
    )
    s.add_argument(
        "--no-request-log",
        dest="request_log",
        action="store_false",
        help="leave out the line logged for each request (id, endpoint, status, tokens, "
        "times, and why a request failed)",
    )
    timeouts = s.add_argument_group("read timeouts (seconds; 0: none)")
    timeouts.add_argument(
        "--header-timeout",
        type=float,
        default=limits.HEADER_TIMEOUT_S,
        help="a request head must be in within this of its first byte, else 408 "
        f"(default {limits.HEADER_TIMEOUT_S:g})",
    )
    timeouts.add_argument(
        "--body-timeout",
        type=float,
        default=limits.BODY_TIMEOUT_S,
        help="a request body must be in within this of its head, else 408 "
        f"(default {limits.BODY_TIMEOUT_S:g})",
    )
    timeouts.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=limits.KEEP_ALIVE_S,
        help="a connection idle this long, new or between requests, is closed "
        f"(default {limits.KEEP_ALIVE_S:g})",
    )
    add_engine_args(s, max_active=limits.SERVE_MAX_ACTIVE, prefix_cache=True)
    s.set_defaults(func=cmd_serve)
    return s


def cmd_serve(args: argparse.Namespace) -> int:
    from edge0.cli.args import engine_options, model_path
    from edge0.engine.load import load_engine
    from edge0.server import requestlog
    from edge0.server.app import ServerOptions, create_app
    from edge0.server.lifecycle import serve
    from edge0.util.threads import ComputeThread

    if args.default_max_tokens < 0:
        raise ValueError(
            f"--default-max-tokens must be at least 0 (0: to the end of the context), "
            f"got {args.default_max_tokens}"
        )
    if args.shutdown_grace < 0:
        raise ValueError(f"--shutdown-grace must be at least 0, got {args.shutdown_grace}")
    timeouts = read_timeouts(args)
    requestlog.configure(args.log_format, args.request_log)
    api_key = args.api_key
    if args.api_key_file is not None:
        lines = args.api_key_file.read_text().split()
        if not lines:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        api_key = lines[0]
    check_bind(args.host, api_key)
    opts = engine_options(args)
    # loaded, run and closed on one thread: the main thread keeps the signals (threads.py)
    compute = ComputeThread("edge0-generate")
    try:
        engine = compute.call(load_engine, model_path(args.model_dir), opts)
    except BaseException:
        compute.close()
        raise
    name = args.model_name or served_name(args.model_dir, engine.path)
    try:
        app = create_app(
            engine,
            ServerOptions(
                model_name=name,
                api_key=api_key,
                queue_size=args.queue_size,
                max_body_bytes=args.max_body,
                default_max_tokens=args.default_max_tokens or None,
                tracebacks=getattr(args, "debug", False),
                body_timeout_s=timeouts.body_s,
            ),
            compute,
        )
        print(f"edge0: serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
        level = "info" if getattr(args, "verbose", False) else "warning"
        worker = app.state.edge0.worker
        served = serve(app, worker, args.host, args.port, level, args.shutdown_grace, timeouts)
    finally:
        compute.call(engine.close)
        compute.close()
    if not served:
        return 1  # uvicorn said why
    print(f"edge0: stopped serving {name}", file=sys.stderr)
    return 0
