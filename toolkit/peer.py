"""Run one peer from a shell: ``python -m toolkit.peer --relay URL`` (the demo spawns these).

It plays the role the run calls for, as ``join()`` does: a trainer, or a stage worker on a run cut
into pipeline stages. Its trainer flags keep their defaults for a trainer; given to a stage worker,
``join()`` refuses them in one line (the stage worker would not use them).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import torch

from toolkit.client import RelayClient
from toolkit.errors import CollabError
from toolkit.runtime.parent import die_with_parent
from toolkit.session import join, role_for


def arguments() -> argparse.ArgumentParser:
    """The command line (the demo's and a volunteer's shell)."""
    parser = argparse.ArgumentParser(prog="python -m toolkit.peer", description=__doc__)
    parser.add_argument("--relay", required=True, help="relay URL, e.g. http://127.0.0.1:8750")
    parser.add_argument("--name", default="peer", help="shown on the dashboard (default: peer)")
    parser.add_argument(
        "--token-env",
        default="HF_TOKEN",
        help="environment variable holding your Hugging Face token, for runs that need a login "
        "(default HF_TOKEN; open runs need none)",
    )
    parser.add_argument(
        "--trusted-model",
        action="append",
        default=[],
        metavar="PACKAGE",
        help="a package whose model class this machine may build (a run with [model] kind = "
        '"module"); repeat for several',
    )
    parser.add_argument("--batch-size", type=int, default=None, help="samples per micro-batch (default 8)")
    parser.add_argument("--seed", type=int, default=None, help="data order seed (default: from the peer id)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--max-steps", type=int, default=None, help="leave after this many global steps")
    parser.add_argument("--max-seconds", type=float, default=None, help="leave after this many seconds")
    parser.add_argument(
        "--delayed-updates",
        action="store_true",
        help="compute the next batch while a round is in flight (needs run.max_staleness >= 1)",
    )
    parser.add_argument(
        "--moe-in-flight",
        type=int,
        default=None,
        metavar="J",
        help="a run with mixture layers: J micro-batches in flight (default: sized from "
        "the measured compute and expert latency; 1: one at a time)",
    )
    parser.add_argument(
        "--report-interval",
        type=float,
        default=None,
        metavar="S",
        help="least seconds between two progress reports (default 0.5; 0: after every micro-batch, "
        "so a step applies at most one micro-batch of this peer's beyond the target)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="log each step")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, _interrupt)  # terminate = leave cleanly, like closing the tab
    die_with_parent()  # started by the demo: SIGTERM when it dies, however it dies
    try:
        result = join(args.relay, **options_of(args))
    except CollabError as exc:
        print(f"{args.name}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.__dict__))
    return 0


def options_of(args: argparse.Namespace) -> dict:
    """The role the run calls for and its options from the command line (a trainer's flags left
    out keep the trainer's defaults; ``--delayed-updates`` left out is off, as it always was here)."""
    client = RelayClient(args.relay)
    try:
        role = role_for(client.get_run())
    finally:
        client.close()
    options = dict(
        role=role,
        token=os.environ.get(args.token_env) or None,
        peer_name=args.name,
        seed=args.seed,
        max_steps=args.max_steps,
        max_seconds=args.max_seconds,
    )
    trainer = dict(
        trusted_models=args.trusted_model,
        batch_size=args.batch_size,
        delayed_updates=args.delayed_updates,
        moe_in_flight=args.moe_in_flight,
        report_interval_s=args.report_interval,
    )
    if role == "trainer":
        return {**options, **{k: v for k, v in trainer.items() if v is not None}, "verbose": args.verbose}
    typed = {k: v for k, v in trainer.items() if v is not None and v is not False and v != []}
    return {**options, **typed}  # a stage worker: a trainer's flag typed is refused by join()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
