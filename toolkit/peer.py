"""Run one peer from a shell: ``python -m toolkit.peer --relay URL`` (the demo spawns these)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

import torch

from toolkit.errors import CollabError
from toolkit.session import join


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.peer", description=__doc__)
    parser.add_argument("--relay", required=True, help="relay URL, e.g. http://127.0.0.1:8750")
    parser.add_argument("--name", default="peer")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--max-seconds", type=float, default=None)
    parser.add_argument("--delayed-updates", action="store_true")
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, _interrupt)  # terminate = leave cleanly, like closing the tab
    try:
        result = join(args.relay, batch_size=args.batch_size, peer_name=args.name, seed=args.seed,
                      max_steps=args.max_steps, max_seconds=args.max_seconds,
                      delayed_updates=args.delayed_updates, verbose=args.verbose)
    except CollabError as exc:
        print(f"{args.name}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.__dict__))
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
