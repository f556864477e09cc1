"""relay-server: run a relay, an extra aggregator, or a complete local demo collaboration.

    relay-server init run.toml                    # a commented configuration to edit
    relay-server serve --config run.toml          # an organizer's relay
    relay-server aggregator --coordinator https://relay.example --port 8751 \
        --public-url https://agg1.example --admin-token-file admin_token   # more bandwidth
    relay-server demo --peers 3 --steps 30        # relay + CPU peers on this machine
    relay-server trial --config run.toml          # your run, one local peer, before anyone joins
    relay-server tokenizer train --config run.toml   # the run's tokenizer.json (model.config.vocab_size)
    relay-server export --config run.toml --data-dir relay-data --out ckpt   # a loadable checkpoint
    relay-server notebook colab --url https://relay.example.org -o my-run.ipynb   # what volunteers open
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from importlib import metadata, resources
from pathlib import Path

from relay_server.core.config import ConfigError, load_config
from relay_server.core.data_lock import DataDirInUse


def version() -> str:
    try:
        return metadata.version("collabtrain")
    except metadata.PackageNotFoundError:  # run from a checkout, uninstalled
        return "unknown (not installed)"


def _codec_name(name: str) -> str:
    """``--compression``'s type: a codec name the run accepts (one line naming the choices otherwise)."""
    from toolkit.wire.compression import codec_error

    problem = codec_error(name)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relay-server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"collabtrain {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    init = sub.add_parser(
        "init", help="write a commented run configuration to edit (auth on, an allowlist to fill in)"
    )
    init.add_argument("path", help="the TOML file to write, e.g. my-run.toml")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")

    serve = sub.add_parser("serve", help="run the relay for a collaboration")
    serve.add_argument("--config", help="the run's configuration (TOML; relay-server init writes one)")
    serve.add_argument("--host", help="bind address (overrides server.host)")
    serve.add_argument("--port", type=int, help="port (overrides server.port; 0 = any free port)")
    serve.add_argument(
        "--data-dir",
        help="state directory (overrides server.data_dir; relative to the working "
        "directory, while one in the config file is relative to the file)",
    )
    serve.add_argument("--ready-file", help="write the relay URL here once it accepts connections")
    serve.add_argument("--verbose", "-v", action="store_true", help="log debug details")

    agg = sub.add_parser(
        "aggregator",
        help="an extra server that owns the slices of the vector the relay's plan "
        "assigns it (more bandwidth for the collaboration)",
    )
    agg.add_argument("--coordinator", required=True, help="the relay's URL")
    agg.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 on a VM; default 127.0.0.1)")
    agg.add_argument("--port", type=int, default=8751, help="port (0 = any free port; default 8751)")
    agg.add_argument(
        "--public-url", help="the URL peers and the relay reach this server at (default: http://HOST:PORT as bound)"
    )
    agg.add_argument("--data-dir", default="aggregator-data", help="where this server keeps its slice's versions")
    agg.add_argument(
        "--admin-token-file",
        required=True,
        help="a copy of the relay's <data_dir>/admin_token (the relay writes it on first start)",
    )
    agg.add_argument("--name", help="shown on the dashboard (default: the public URL's host:port, or the bound one)")
    agg.add_argument("--keep-versions", type=int, default=3, help="slice versions kept on disk (default 3)")
    agg.add_argument("--ready-file", help="write this server's URL here once it accepts connections")
    agg.add_argument("--verbose", "-v", action="store_true", help="log debug details")

    demo = sub.add_parser("demo", help="relay + N CPU peers training the byte-level demo model")
    demo.add_argument("--peers", type=int, default=3, help="number of peer processes (default 3)")
    demo.add_argument("--steps", type=int, default=30, help="optimizer steps to run (default 30)")
    demo.add_argument("--target-batch", type=int, default=32, help="global batch per step (default 32)")
    demo.add_argument("--batch-size", type=int, default=8, help="per-peer micro-batch (default 8)")
    demo.add_argument("--data-dir", help="keep the relay state here (default: a temporary directory)")
    demo.add_argument(
        "--port",
        type=int,
        default=0,
        help="the relay's port, where the dashboard is (default 0: any free port; the first line says it)",
    )
    demo.add_argument(
        "--open-round",
        choices=("reported", "projected"),
        default="reported",
        help="when a round opens: at the target reported (steps apply up to one micro-batch per peer "
        "more) or projected (counting the micro-batches in flight: about the target)",
    )
    demo.add_argument(
        "--keep", action="store_true", help="leave the relay and its dashboard up after the last step, until Ctrl-C"
    )
    demo.add_argument(
        "--compression",
        type=_codec_name,
        default="none",
        help="codec for gradients and parameters on the wire: none (default), float16, int8 or "
        "topk2-<K> (the K largest of every 4096 values, 2 bits each: topk2-64 is 0.29 bits/parameter)",
    )
    demo.add_argument(
        "--recipe",
        choices=("byte-lm", "albert-tiny", "pipeline-tiny", "dmoe-lm-tiny"),
        default="byte-lm",
        help="byte-lm: the byte-level demo model; albert-tiny: the sahajBERT recipe in miniature "
        "(tokenizer trained on the shipped text, ALBERT masked-LM, LAMB); pipeline-tiny: the byte-level "
        "model cut into 2 stages, each peer running one (a staged pipeline); dmoe-lm-tiny: Learning@home's "
        "language model in miniature (mixture-of-experts feed-forward blocks, 2 expert host processes)",
    )
    demo.add_argument("--verbose", "-v", action="store_true", help="log debug details")

    trial = sub.add_parser(
        "trial",
        help="try a run's configuration on this machine: its model, objective and data "
        "with one local CPU peer and a small target batch (a pipeline run: one local stage worker per "
        "stage, the run's own batch), open auth on 127.0.0.1, state in a temporary directory; the "
        "dashboard stays up until Ctrl-C",
    )
    trial.add_argument("--config", required=True, help="the run's configuration (TOML; relay-server init writes one)")
    trial.add_argument("--steps", type=int, help="stop after this many optimizer steps (default: run until Ctrl-C)")
    trial.add_argument(
        "--target-batch",
        type=int,
        help="global batch per step (default 16, a pipeline run's own; the run's own target_batch is for the "
        "real collaboration)",
    )
    trial.add_argument(
        "--batch-size", type=int, help="the local peer's micro-batch (default 8, a pipeline run's own microbatch_size)"
    )
    trial.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="the local peers' CPU threads, shared by a pipeline run's stage workers (default: half of this "
        "machine's cores)",
    )
    trial.add_argument(
        "--port",
        type=int,
        default=0,
        help="the relay's port, where the dashboard is (default 0: any free port; the first line says it)",
    )
    trial.add_argument("--verbose", "-v", action="store_true", help="log debug details")

    export = sub.add_parser(
        "export",
        help="write a version of the run as a folder users load (transformers runs: "
        "save_pretrained's layout, AutoModel*.from_pretrained(folder))",
    )
    export.add_argument(
        "--config", help="the TOML the relay ran with (its model and tokenizer); default: the embedded demo run"
    )
    export.add_argument("--data-dir", required=True, help="the relay's state directory (server.data_dir)")
    export.add_argument("--out", required=True, help="folder to write")
    export.add_argument("--step", type=int, help="version to export (default: the latest)")
    export.add_argument("--verbose", "-v", action="store_true", help="log debug details")

    tok = sub.add_parser("tokenizer", help="the run's tokenizer").add_subparsers(dest="action", required=True)
    train = tok.add_parser("train", help="train a tokenizer.json on the run's dataset text")
    train.add_argument("--config", help="run configuration (TOML); default: the embedded demo run")
    train.add_argument(
        "--vocab-size", type=int, help="vocabulary size (default: the config's model.config.vocab_size, else 8000)"
    )
    train.add_argument(
        "--out", help="where to write it (default: [tokenizer] file, else tokenizer.json next to the config)"
    )
    train.add_argument(
        "--model",
        choices=("wordpiece", "bpe", "unigram"),
        default="wordpiece",
        help="segmentation model (default wordpiece; sahajBERT: unigram)",
    )
    train.add_argument("--lowercase", action="store_true", help="lowercase the text first")
    train.add_argument("--max-texts", type=int, help="train on at most this many documents")
    train.add_argument("--verbose", "-v", action="store_true", help="log debug details")

    notebook = sub.add_parser(
        "notebook",
        help="write the one-cell notebook volunteers open: the relay's URL and the "
        "sha256 of the toolkit wheel it serves filled in (pip installs exactly that)",
    )
    notebook.add_argument(
        "platform",
        choices=("colab", "kaggle", "tpu", "local"),
        help="where volunteers run it (tpu: Colab or Kaggle TPU runtimes)",
    )
    notebook.add_argument(
        "--url",
        required=True,
        help="the relay's public address, as volunteers reach it "
        "(e.g. https://relay.example.org); it must be running: it is asked which wheel it serves",
    )
    notebook.add_argument("-o", "--out", required=True, help="the .ipynb file to write, e.g. my-run.ipynb")
    notebook.add_argument(
        "--local-test",
        action="store_true",
        help="allow a loopback, private or plain-http --url "
        "for colab/kaggle/tpu: a notebook you run yourself next to the relay, not one to share",
    )

    from relay_server.api.moderation import add_admin_parser

    add_admin_parser(
        sub
    )  # relay-server admin --url URL [--data-dir DIR] ban|unban|bans|contributions|rollback|checkpoints
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "init":
            return _init(args)
        if args.command == "admin":
            from relay_server.api.moderation import run_admin

            return run_admin(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "aggregator":
            return _aggregator(args)
        if args.command == "tokenizer":
            return _train_tokenizer(args)
        if args.command == "notebook":
            return _notebook(args)
        if args.command == "export":
            return _export(args)
        if args.command == "trial":
            return _trial(args)
        from relay_server.demo import run_demo

        return run_demo(
            peers=args.peers,
            steps=args.steps,
            target_batch=args.target_batch,
            batch_size=args.batch_size,
            data_dir=args.data_dir,
            port=args.port,
            compression=args.compression,
            recipe=args.recipe,
            keep=args.keep,
            open_round=args.open_round,
        )
    except ConfigError as exc:
        print(f"relay-server: configuration error: {exc}", file=sys.stderr)
        return 2
    except DataDirInUse as exc:  # a second relay or aggregator on one state: nothing was touched
        print(f"relay-server: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _trial(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps} (leave it out to run until Ctrl-C)")
    if min(args.target_batch or 1, args.batch_size or 1, args.threads) < 1:
        raise ConfigError("--target-batch, --batch-size and --threads must be at least 1")
    from relay_server.trial import run_trial

    return run_trial(
        args.config,
        steps=args.steps,
        target_batch=args.target_batch,
        batch_size=args.batch_size,
        port=args.port,
        threads=args.threads,
    )


def _init(args: argparse.Namespace) -> int:
    target = Path(args.path)
    if target.exists() and not args.force:
        raise ConfigError(f"{target} exists: edit it, or pass --force to overwrite it")
    target.write_text(resources.files("relay_server").joinpath("defaults/init.toml").read_text())
    print(
        f"wrote {target}: fill in [auth] allow_users or allow_orgs, set [run] and [model], then\n"
        f"  relay-server serve --config {target}\n"
        f"It listens on 127.0.0.1 (behind the TLS proxy in the README) and keeps its state in [server] "
        f"data_dir, relative to {target.resolve().parent}."
    )
    return 0


def _notebook(args: argparse.Namespace) -> int:
    from relay_server.notebooks import write_notebook

    try:
        pin = write_notebook(args.platform, args.url, Path(args.out), local_test=args.local_test)
    except ConfigError as exc:  # not a configuration: say which command failed
        print(f"relay-server notebook: {exc}", file=sys.stderr)
        return 2
    share = (
        "A local test: run it on this machine, do not share it."
        if args.local_test
        else "Share it with volunteers; write it again after upgrading the relay's collabtrain (the old one then "
        "refuses to install)."
    )
    print(
        f"wrote {args.out}: it installs collabtrain {pin.version} from {pin.relay_url}/toolkit/{pin.wheel} "
        f"(sha256 {pin.sha256}) and joins that relay. {share}"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    if not args.config:
        raise ConfigError(
            "relay-server serve needs --config RUN.toml: write one with `relay-server init RUN.toml` "
            "(login on, an allowlist to fill in), or try everything locally with `relay-server demo`"
        )
    overrides = {
        "server": {
            k: v for k, v in (("host", args.host), ("port", args.port), ("data_dir", args.data_dir)) if v is not None
        }
    }
    config = load_config(args.config, overrides=overrides)  # before the server's imports: a bad file fails at once
    if not config.server.data_dir:  # never a new run wherever serve happened to start
        raise ConfigError(
            f'server.data_dir is not set: add data_dir = "relay-data" under [server] in {args.config} '
            "(relative to that file), or pass --data-dir DIR"
        )
    from relay_server.api.server import serve

    logging.getLogger("relay_server").setLevel(logging.INFO)
    asyncio.run(serve(config, ready_file=args.ready_file, on_ready=_announce))
    return 0


def _export(args: argparse.Namespace) -> int:
    from relay_server.observers.pretrained import export_version

    if not Path(args.data_dir).is_dir():
        raise ConfigError(f"--data-dir {args.data_dir} is not a directory: pass the relay's server.data_dir")
    source = f"--config {args.config}" if args.config else "the embedded demo run (no --config)"
    step = export_version(
        load_config(args.config), Path(args.data_dir), Path(args.out), args.step, config_source=source
    )
    print(f"version {step} written to {args.out}")
    return 0


def _announce(url: str) -> None:
    """What an organizer reads first: where the dashboard is (the address bound, so ``--port 0``
    says which port it got) and the command that comes next."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    here = f"http://127.0.0.1:{port}" if host in ("0.0.0.0", "::", "[::]") else url  # a wildcard is no link
    print(
        f"relay-server: listening on {url}; the dashboard is at {here}/\n"
        f"next, behind your HTTPS proxy, write the notebook volunteers open:\n"
        f"  relay-server notebook colab --url https://<your public address> -o run.ipynb",
        flush=True,
    )


def _train_tokenizer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from relay_server.core.model_checks import vocabulary_fits
    from relay_server.data.tokenizer_train import train_for_run

    config = load_config(args.config, run_data=False)  # the tokenizer it names may not exist yet
    base = Path(args.config).parent if args.config else Path.cwd()
    out = Path(args.out) if args.out else base / (config.tokenizer.file or "tokenizer.json")
    model_vocab = config.model.config.get("vocab_size") if config.model.kind == "transformers" else None
    vocab_size = args.vocab_size or (model_vocab if isinstance(model_vocab, int) else 8000)
    if vocab_size <= 5:
        raise ConfigError("--vocab-size must leave room beyond the 5 special tokens")
    if not args.vocab_size:
        print(
            f"vocabulary size {vocab_size}: "
            + ("the config's model.config.vocab_size" if vocab_size == model_vocab else "the default")
            + " (--vocab-size sets another)"
        )
    tok = train_for_run(
        config, str(out), vocab_size=vocab_size, model=args.model, lowercase=args.lowercase, max_texts=args.max_texts
    )
    size = tok.get_vocab_size()
    print(
        f'wrote {out}: {size} tokens ({args.model}); name it in the run\'s config as [tokenizer] file = "{out.name}"'
    )
    if isinstance(model_vocab, int) and not vocabulary_fits(model_vocab, size):
        print(
            f"note: the text yields {size} tokens, model.config.vocab_size is {model_vocab}: set "
            f"model.config.vocab_size = {size} (relay-server serve checks the two)"
        )
    return 0


def _aggregator(args: argparse.Namespace) -> int:
    from relay_server.aggregator import serve_aggregator
    from relay_server.api.moderation import read_token

    if not args.coordinator.startswith(("http://", "https://")):
        raise ConfigError(f"--coordinator must be the relay's http(s) URL, got {args.coordinator!r}")
    try:
        token = read_token(args.admin_token_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--admin-token-file: {exc}") from None
    name = args.name or (args.public_url.split("://")[-1].rstrip("/") if args.public_url else None)  # else as bound
    logging.getLogger("relay_server").setLevel(logging.INFO)
    asyncio.run(
        serve_aggregator(
            coordinator=args.coordinator,
            host=args.host,
            port=args.port,
            public_url=args.public_url,
            data_dir=args.data_dir,
            token=token,
            name=name[:128] if name else None,
            keep_versions=max(2, args.keep_versions),
            ready_file=args.ready_file,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
