"""``tokenmill route``: the KV-aware router in front of many OpenAI-compatible replicas."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from tokenmill.router.policies import DEFAULT_POLICY, POLICIES

if TYPE_CHECKING:
    from tokenmill.router.app import RouterConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas")
    g.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="replica base URL (http://host:port); repeat for more")
    g.add_argument("--replica-file", metavar="FILE",
                   help="file with one replica URL per line; reloaded when it changes")
    g.add_argument("--replica-dns", action="append", default=[], metavar="NAME:PORT",
                   help="DNS name whose A records are the replicas (re-resolved periodically); repeatable")
    g.add_argument("--discovery-interval", type=float, default=2.0, metavar="S",
                   help="seconds between replica-file / DNS refreshes (default 2)")
    g.add_argument("--health-interval", type=float, default=2.0, metavar="S", help="seconds between health checks")
    g.add_argument("--health-path", default="/health", help="replica health endpoint (default /health)")
    g.add_argument("--failure-threshold", type=int, default=2,
                   help="failures in a row that mark a replica unhealthy (default 2)")
    g.add_argument("--recovery-threshold", type=int, default=2,
                   help="successful checks in a row that bring it back (default 2)")
    g.add_argument("--load-interval", type=float, default=0.5, metavar="S",
                   help="seconds between load polls (/v1/loads, else /metrics)")
    g.add_argument("--health-timeout", type=float, default=2.0, metavar="S",
                   help="a health check slower than this fails (default 2)")
    g.add_argument("--breaker-threshold", type=int, default=3,
                   help="failed proxied requests in a row that open a replica's circuit (default 3)")
    g.add_argument("--breaker-cooldown", type=float, default=5.0, metavar="S",
                   help="seconds an open circuit keeps requests off the replica before a trial (default 5)")
    g.add_argument("--replica-api-key", default=os.environ.get("TOKENMILL_REPLICA_API_KEY"),
                   help="key sent to the replicas (requests and polls) instead of the client's header")
    g.add_argument("--replica-admin-key", default=os.environ.get("TOKENMILL_REPLICA_ADMIN_KEY"),
                   help="key sent with the /flush_cache fan-out (default: --replica-api-key)")
    p = parser.add_argument_group("policy")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   help=f"routing policy (default {DEFAULT_POLICY})")
    p.add_argument("--session-max-inflight", type=int, help="agentic: a session's requests on one replica before splitting (2)")
    p.add_argument("--epsilon", type=float, help="agentic: load bound slack over the mean (0.25)")
    p.add_argument("--load-floor", type=float, help="agentic: active requests below which no replica is hot (4)")
    p.add_argument("--session-ttl", type=float, help="agentic: seconds an idle session is remembered (600)")
    p.add_argument("--rebalance-after", type=float, help="agentic: seconds above the bound before a session moves (30)")
    p.add_argument("--shared-cache", action="store_true", default=None,
                   help="agentic: the replicas share an L3 cache tier (--cache-storage), so idle sessions "
                        "may move to less loaded replicas")
    p.add_argument("--shared-move-margin", type=int,
                   help="agentic with --shared-cache: home's extra active requests before a move (2)")
    p.add_argument("--seed", type=int, help="random / session_hash: seed for requests without a session")
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--admin-key", default=os.environ.get("TOKENMILL_ADMIN_KEY"),
                   help="enables GET/POST /replicas, DELETE /replicas/{id} and guards /flush_cache with this "
                        "bearer key (default: $TOKENMILL_ADMIN_KEY)")
    s.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $TOKENMILL_API_KEY)")
    s.add_argument("--connect-timeout", type=float, default=5.0, metavar="S")
    o = parser.add_argument_group("overload")
    o.add_argument("--max-inflight", type=int, default=None,
                   help="requests in flight across the fleet at most; more get 429 + Retry-After")
    o.add_argument("--max-inflight-per-replica", type=int, default=None,
                   help="requests in flight on one replica at most; a full replica is skipped, all full: 429")
    o.add_argument("--max-attempts", type=int, default=3, help="replicas tried per request (default 3)")
    o.add_argument("--retry-after-s", type=int, default=1, help="Retry-After of the router's 429s (default 1)")
    o.add_argument("--max-request-bytes", type=int, default=32 * 2**20,
                   help="largest accepted body, refused with 413 before parsing (default 32 MiB)")
    o.add_argument("--max-json-depth", type=int, default=64, help="deepest accepted JSON nesting (default 64)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """CLI flags -> RouterConfig; raises ValueError with a user-facing message."""
    from tokenmill.router.app import RouterConfig
    from tokenmill.router.replicas import HealthConfig

    options = {}
    if args.policy == "agentic":
        options = {"session_max_inflight": args.session_max_inflight, "epsilon": args.epsilon,
                   "load_floor": args.load_floor, "session_ttl_s": args.session_ttl,
                   "rebalance_after_s": args.rebalance_after, "shared_cache": args.shared_cache,
                   "shared_move_margin": args.shared_move_margin}
    elif args.policy in ("random", "session_hash"):
        options = {"seed": args.seed}
    health = HealthConfig(health_path=args.health_path, health_interval_s=args.health_interval,
                          failure_threshold=args.failure_threshold, recovery_threshold=args.recovery_threshold,
                          load_interval_s=args.load_interval, health_timeout_s=args.health_timeout,
                          breaker_threshold=args.breaker_threshold, breaker_cooldown_s=args.breaker_cooldown)
    return RouterConfig(replicas=list(args.replica), replica_file=args.replica_file,
                        replica_dns=list(args.replica_dns), policy=args.policy,
                        policy_options={k: v for k, v in options.items() if v is not None},
                        admin_key=args.admin_key, health=health, discovery_interval_s=args.discovery_interval,
                        connect_timeout_s=args.connect_timeout, api_key=args.api_key or None,
                        replica_api_key=args.replica_api_key or None, replica_admin_key=args.replica_admin_key or None,
                        max_inflight=args.max_inflight, max_inflight_per_replica=args.max_inflight_per_replica,
                        max_attempts=args.max_attempts, retry_after_s=args.retry_after_s,
                        max_request_bytes=args.max_request_bytes, max_json_depth=args.max_json_depth)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        from tokenmill.router.app import build_app

        app = build_app(config)
    except ValueError as e:
        print(f"tokenmill route: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0
