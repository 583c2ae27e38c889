"""``tokenmill serve``: load one model and serve it over the OpenAI API.

The port is bound first (a port in use fails in a second, before a model is loaded), but it is
listened on only once the model is loaded, so ``GET /health`` answers 200 only once the server can
serve. SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish for up to
``--shutdown-grace-s`` seconds, aborts the rest, stops the engine and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Generator
from pathlib import Path

import uvicorn

from tokenmill.engine.cli import add_engine_arguments, engine_config_from_args
from tokenmill.server.tool_parser import TOOL_PARSERS

logger = logging.getLogger("tokenmill.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)   # every EngineConfig field, shared with `tokenmill generate`
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the 'model' field (default: the --model value)")
    s.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="turn tool-call markup in the output into OpenAI tool_calls")
    s.add_argument("--chat-template", default=None, metavar="PATH",
                   help="Jinja chat template file to use instead of the tokenizer's")
    s.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $TOKENMILL_API_KEY, or no key)")
    s.add_argument("--admin-key", default=os.environ.get("TOKENMILL_ADMIN_KEY"),
                   help="key that POST /flush_cache needs instead of the API key "
                        "(default: $TOKENMILL_ADMIN_KEY, or the API key)")
    s.add_argument("--max-stored-responses", type=int, default=1024,
                   help="responses kept for previous_response_id and GET /v1/responses/{id} (default: 1024)")
    s.add_argument("--max-n", type=int, default=8, help="largest accepted 'n' (default: 8)")
    s.add_argument("--max-request-bytes", type=int, default=32 * 2**20,
                   help="largest accepted request body, refused with 413 before it is parsed (default: 32 MiB)")
    s.add_argument("--max-json-depth", type=int, default=64,
                   help="deepest accepted nesting of JSON arrays/objects in a body; deeper gets 400 (default: 64)")
    o = parser.add_argument_group("overload")
    o.add_argument("--max-waiting-requests", type=int, default=None,
                   help="bound of the engine's waiting queue; requests past it get 429 + Retry-After "
                        "(default: unbounded)")
    o.add_argument("--max-queue-wait-s", type=float, default=None,
                   help="a request predicted not to start within this many seconds gets 429 at once; one "
                        "queued that has not started by then fails with 503 and is freed (default: no limit)")
    o.add_argument("--request-deadline-s", type=float, default=None,
                   help="default and upper bound of a request's deadline (its 'deadline_s' field): past it "
                        "the request finishes with finish_reason 'deadline' (default: none)")
    o.add_argument("--retry-after-s", type=int, default=1, help="Retry-After of 429 / 503 answers (default: 1)")
    s.add_argument("--tokenizer-workers", type=int, default=2,
                   help="threads that tokenize long prompts off the event loop, each with its own tokenizer "
                        "copy, all started at start-up (default: 2)")
    s.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish before they are aborted")
    s.add_argument("--log-token-ids", default=None, metavar="DIR",
                   help="write one JSONL record per finished request (prompt and output token ids, "
                        "model, sampling settings) under DIR, e.g. to train a drafter")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s.add_argument("--log-requests", action="store_true",
                   help="log prompts and outputs (off by default: logs carry sizes and timings only)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.engine import Engine
    from tokenmill.contracts.errors import ReplicaFailedError
    from tokenmill.loader.resolve import ModelNotFoundError
    from tokenmill.server.app import build_app
    from tokenmill.server.common import ServerConfig, ServerState

    try:
        engine_config = engine_config_from_args(args)
        chat_template = Path(args.chat_template).read_text() if args.chat_template else None
        server_config = ServerConfig(
            served_model_names=tuple(args.served_model_name or [args.model]), max_n=args.max_n,
            max_request_bytes=args.max_request_bytes, api_key=args.api_key or None,
            tool_call_parser=args.tool_call_parser, chat_template=chat_template,
            shutdown_grace_s=args.shutdown_grace_s, admin_key=args.admin_key or None,
            max_json_depth=args.max_json_depth, max_waiting_requests=args.max_waiting_requests,
            max_queue_wait_s=args.max_queue_wait_s, request_deadline_s=args.request_deadline_s,
            retry_after_s=args.retry_after_s, log_requests=args.log_requests, max_stored_responses=args.max_stored_responses,
            log_token_ids=args.log_token_ids, tokenizer_workers=args.tokenizer_workers,
        )
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    except (ValueError, OSError) as e:
        print(f"tokenmill serve: {e}", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"tokenmill serve: could not start the HTTP server on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    try:
        engine = Engine(engine_config)
    except (ModelNotFoundError, ValueError) as e:
        sock.close()
        print(f"tokenmill serve: cannot start with model {args.model!r}: {e}", file=sys.stderr)
        return 2
    except ReplicaFailedError as e:
        sock.close()
        print(f"tokenmill serve: {e}", file=sys.stderr)
        return 1
    server: _Server | None = None

    def on_fatal(exc: BaseException) -> None:  # engine thread: stop the HTTP server, exit non-zero
        if server is not None:
            server.should_exit = True
            timer = threading.Timer(5.0, lambda: setattr(server, "force_exit", True))
            timer.daemon = True
            timer.start()

    # The engine loop runs on this (the main) thread and the HTTP event loop on a thread of its
    # own: torch's OpenMP kernels lose their parallel speed-up when a non-main thread starts
    # their parallel regions (see tokenmill.engine.async_engine).
    async_engine = AsyncEngine(engine, on_fatal=on_fatal, start_thread=False)
    state = ServerState.create(async_engine, server_config, prefix_cache_enabled=engine_config.enable_prefix_cache)
    port = sock.getsockname()[1]   # the port given, or the one the system chose for --port 0
    logger.info("serving %s as %s on http://%s:%d (max_model_len=%d)", args.model,
                ", ".join(server_config.served_model_names), args.host, port, state.max_model_len)
    uv_config = uvicorn.Config(build_app(state), host=args.host, port=port, log_level=args.log_level,
                               timeout_graceful_shutdown=args.shutdown_grace_s, access_log=False,
                               timeout_keep_alive=30)
    server = _Server(uv_config)

    def serve_http() -> None:
        try:
            server.run(sockets=[sock])
        except SystemExit:   # uvicorn exits when it cannot listen; reported below (not started)
            pass
        except BaseException:  # noqa: BLE001 - the engine loop must stop whatever happened here
            logger.exception("the HTTP server failed")
        finally:
            async_engine.shutdown()   # no-op when the app's shutdown already stopped it

    http = threading.Thread(target=serve_http, name="tokenmill-http", daemon=True)
    # uvicorn installs signal handlers only on the main thread, which is the engine's here
    originals = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        async_engine.run_forever()
    finally:
        server.should_exit = True   # the engine loop ended first (a fatal error): stop serving
        http.join()
        for sig, handler in originals.items():
            signal.signal(sig, handler)
        sock.close()
    if async_engine.fatal_error is not None:
        print(f"tokenmill serve: the model replica failed, shutting down: {async_engine.fatal_error}",
              file=sys.stderr)
        return 1
    if not server.started:
        print(f"tokenmill serve: could not start the HTTP server on {args.host}:{args.port}", file=sys.stderr)
        return 1
    logger.info("server stopped")
    return 0


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (a name, an IPv4 or an IPv6 address), not yet listening:
    the port is reserved while the model loads, and connections are refused until uvicorn listens
    on it."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, run on a thread other than the main one, so it installs no signal
    handlers: :func:`run` routes SIGINT/SIGTERM to :meth:`handle_exit` from the main thread, and
    nothing re-raises the signal after a graceful stop (which must exit 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
