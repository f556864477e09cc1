"""``relay-server``: run a relay, or a complete local demo collaboration.

    relay-server serve --config run.toml          # an organizer's relay
    relay-server demo --peers 3 --steps 30        # relay + CPU peers on this machine
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from relay_server.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relay-server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the relay for a collaboration")
    serve.add_argument("--config", help="run configuration (TOML); default: the embedded demo run")
    serve.add_argument("--host", help="bind address (overrides server.host)")
    serve.add_argument("--port", type=int, help="port (overrides server.port; 0 = any free port)")
    serve.add_argument("--data-dir", help="state directory (overrides server.data_dir)")
    serve.add_argument("--ready-file", help="write the relay URL here once it accepts connections")
    serve.add_argument("--verbose", "-v", action="store_true")

    demo = sub.add_parser("demo", help="relay + N CPU peers training the byte-level demo model")
    demo.add_argument("--peers", type=int, default=3, help="number of peer processes (default 3)")
    demo.add_argument("--steps", type=int, default=30, help="optimizer steps to run (default 30)")
    demo.add_argument("--target-batch", type=int, default=32, help="global batch per step (default 32)")
    demo.add_argument("--batch-size", type=int, default=8, help="per-peer micro-batch (default 8)")
    demo.add_argument("--data-dir", help="keep the relay state here (default: a temporary directory)")
    demo.add_argument("--port", type=int, default=0)
    demo.add_argument("--verbose", "-v", action="store_true")

    from relay_server.moderation import add_admin_parser, run_admin

    add_admin_parser(sub)  # relay-server admin --url URL [--data-dir DIR] ban|unban|bans|contributions|rollback|checkpoints

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "admin":
            return run_admin(args)
        if args.command == "serve":
            return _serve(args)
        from relay_server.demo import run_demo

        return run_demo(peers=args.peers, steps=args.steps, target_batch=args.target_batch,
                        batch_size=args.batch_size, data_dir=args.data_dir, port=args.port)
    except ConfigError as exc:
        print(f"relay-server: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _serve(args: argparse.Namespace) -> int:
    from relay_server.server import serve

    overrides = {"server": {k: v for k, v in (("host", args.host), ("port", args.port), ("data_dir", args.data_dir))
                            if v is not None}}
    config = load_config(args.config, overrides=overrides)
    logging.getLogger("relay_server").setLevel(logging.INFO)
    asyncio.run(serve(config, ready_file=args.ready_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
