"""A real peer process that trains a run through one of the loops people use, building the model
and batches as a user's own loop does (``toolkit.run_model`` and ``opt.batches()``, the optimizer
taking the run's pinned precision by itself):

    --loop plain|trainer|accelerate|lightning  --accumulation K  [--skip-micro-batch J]

With a run pinned to bf16 each loop trains under bfloat16 autocast; pinned to fp16, under
float16 autocast with a GradScaler; on CPU the
frameworks turn fp16 off, so the harness gives them the CPU ``torch.amp.GradScaler`` they would
build on a GPU. ``--skip-micro-batch J`` makes micro-batch J's gradient infinite, so the scaler
skips that accumulation window (an overflow, deterministically).

It records what the exactness tests need to rebuild every round in one process: each training
forward's inputs (``<result>.batches.pt``) and, from the accumulator, which accumulation windows
went into which round. With ``--barrier`` the peers' first forwards wait for each other, so no
loop's set-up time keeps it out of the rounds (local SGD's outer round waits only for the peers
that joined). Every loop ends by itself when the run finishes.

``--lockstep``: a window's first forward waits until this peer's last window went to a round and
that round closed (the optimizer's own ``sync()`` keeps reporting and contributing meanwhile).
The relay opens a round once the reported samples reach ``target_batch`` and closes it when the
peers expected at its opening delivered; free-running loops therefore race: which windows make a
round depends on how the OS schedules the processes. A test whose target is one window of each
peer gets, on a loaded machine, rounds made by the faster loop alone -- the HF Trainer at k = 2
reporting two windows (8 samples) before a plain k = 1 loop's first, or the plain loop reporting
three (6) before the Trainer's first report reached the relay -- and a peer whose gradient no
round counted. With lockstep no peer holds more than one window, so a round can only open once
every peer added its window, and each round holds exactly one window of each peer.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

MAX_LOCAL_STEPS = 5000  # a safety net: the run's end stops every loop long before
KEYS = ("input_ids", "attention_mask", "labels", "token_type_ids")


def run_plain(model, opt, args, precision: str) -> None:
    fp16 = precision == "fp16"
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    losses: list[float] = []
    for i, batch in enumerate(opt.batches()):
        with torch.autocast("cpu", dtype=torch.float16 if fp16 else torch.bfloat16, enabled=precision != "fp32"):
            loss = model(**batch).loss
        losses.append(loss.item())
        loss = loss / args.accumulation
        (scaler.scale(loss) if scaler else loss).backward()
        if (i + 1) % args.accumulation:
            continue
        step = dict(loss=sum(losses) / len(losses), batch_size=args.batch_size * args.accumulation)
        if scaler:
            scaler.step(opt, **step)  # skipped when the gradients overflowed
            scaler.update()
        else:
            opt.step(**step)
        opt.zero_grad()
        losses.clear()


def run_trainer(model, opt, args, precision: str) -> None:
    fp16 = precision == "fp16"
    from transformers import Trainer, TrainingArguments

    from toolkit.integrations.hf_trainer import CollaborativeCallback, run_dataset

    targs = TrainingArguments(
        output_dir=args.workdir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        max_steps=MAX_LOCAL_STEPS,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        fp16=fp16,
        bf16=precision == "bf16",
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=run_dataset(opt),
        optimizers=(opt, None),
        callbacks=[CollaborativeCallback(opt)],
    )
    if fp16:  # what Accelerate builds on a GPU
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
        trainer.accelerator.native_amp = True
    trainer.train()


def run_accelerate(model, opt, args, precision: str) -> None:
    fp16 = precision == "fp16"
    from accelerate import Accelerator

    from toolkit.integrations import watch_loss

    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=args.accumulation,
        mixed_precision={"fp32": "no"}.get(precision, precision),
    )
    if fp16:  # what Accelerate builds on a GPU
        accelerator.scaler = torch.amp.GradScaler("cpu")
        accelerator.native_amp = True
    model, wrapped = accelerator.prepare(model, opt)
    handle = watch_loss(model, wrapped)
    for batch in opt.batches():
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            wrapped.step()
            wrapped.zero_grad()
    handle.remove()


def run_lightning(model, opt, args, precision: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from toolkit.integrations.lightning import CollaborativeLightningCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return opt

    plugins = {
        "fp16": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        "bf16": [MixedPrecision("bf16-mixed", "cpu")],
    }.get(precision, [])
    trainer = pl.Trainer(
        max_steps=MAX_LOCAL_STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accumulate_grad_batches=args.accumulation,
        plugins=plugins,
        callbacks=[CollaborativeLightningCallback()],
    )
    trainer.fit(Module(), opt.batches())


LOOPS = {"plain": run_plain, "trainer": run_trainer, "accelerate": run_accelerate, "lightning": run_lightning}


class Recorder:
    """Each training forward's inputs, and the accumulator's adds, takes and discards and what
    became of each upload, in order; with ``lockstep``, each window waits for the last one's round
    (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        opt: Any,
        skip: int | None,
        barrier: tuple[Path, str, int] | None,
        lockstep: bool,
    ) -> None:
        self.forwards: list[dict[str, torch.Tensor]] = []
        self.events: list[list] = []
        self.skip = skip
        self.barrier = barrier
        self.opt = opt
        self.lockstep = lockstep
        model.register_forward_pre_hook(self.on_forward, with_kwargs=True)
        acc = opt.accumulator
        for name in ("add", "take", "discard", "restore"):
            setattr(acc, name, self.wrap(name, getattr(acc, name)))
        settle = opt.rounds.settle  # what became of each upload: applied, or not (a round closed without it)

        def settled(outcome: Any) -> None:
            applied = outcome.version is not None or outcome.fate == "applied"
            self.events.append(["settle", outcome.upload.meta.step, applied])
            settle(outcome)

        opt.rounds.settle = settled

    def on_forward(self, module, args, kwargs) -> None:
        if not torch.is_grad_enabled():
            return
        if not self.forwards and self.barrier is not None:  # every loop set up: all start computing at once
            directory, name, peers = self.barrier
            (directory / name).touch()
            deadline = time.monotonic() + 600
            while len(list(directory.iterdir())) < peers and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.lockstep:
            self.wait_for_last_window()
        self.forwards.append({k: kwargs[k].detach().clone() for k in KEYS if k in kwargs})
        if len(self.forwards) - 1 == self.skip:  # an overflow in this micro-batch's backward
            param = next(module.parameters())
            handle = param.register_hook(lambda g: (handle.remove(), g * float("inf"))[1])

    def wait_for_last_window(self) -> None:
        """Hold this forward while the accumulator still holds a window: the optimizer's
        ``sync()`` reports it and, once its round opens, sends it and waits for the version that
        round produces (without delayed updates, in this thread), so an empty accumulator means
        the round holding the last window closed. Within a window the accumulator is empty (the
        window is added at its step), so only a window's first forward ever waits."""
        opt = self.opt
        deadline = time.monotonic() + 600  # the test's own timeout ends a peer stuck longer
        while opt.samples and not opt.finished and time.monotonic() < deadline:
            opt.sync()
            time.sleep(0.02)

    def wrap(self, name: str, method):
        def recorded(*a, **kw):
            out = method(*a, **kw)
            if name == "add":
                self.events.append(["add", a[1], len(self.forwards)])  # samples, forwards so far
            elif name == "take":
                meta = out[0]
                self.events.append(["take", meta.step, meta.samples, meta.loss_sum])
            else:
                self.events.append([name])
            return out

        return recorded


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--relay", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--loop", choices=sorted(LOOPS), required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--skip-micro-batch", type=int, default=None)
    parser.add_argument("--barrier", help="a directory: compute the first micro-batch once --peers loops wait there")
    parser.add_argument("--peers", type=int, default=1)
    parser.add_argument("--lockstep", action="store_true", help="each window waits for the last one's round to close")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    torch.set_num_threads(1)

    import toolkit

    if args.loop == "trainer":  # pay the loop's imports before joining, so peers start together
        import transformers.trainer  # noqa: F401
    elif args.loop == "accelerate":
        import accelerate  # noqa: F401
    elif args.loop == "lightning":
        import lightning.pytorch  # noqa: F401
    model = toolkit.run_model(args.relay)
    model.train()
    opt = toolkit.CollaborativeOptimizer(
        model, args.relay, batch_size_per_step=args.batch_size, peer_name=args.name, report_interval_s=0.05
    )
    barrier = (Path(args.barrier), args.name, args.peers) if args.barrier else None
    recorder = Recorder(model, opt, args.skip_micro_batch, barrier, args.lockstep)
    try:
        LOOPS[args.loop](model, opt, args, opt.precision or "fp32")
    except KeyboardInterrupt:
        pass
    finally:
        opt.close()
    torch.save(recorder.forwards, args.result + ".batches.pt")
    with open(args.result, "w") as out:
        json.dump(
            {
                "loop": args.loop,
                "accumulation": args.accumulation,
                "precision": opt.precision,
                "contributed_samples": opt.contributed_samples,
                "version": opt.version,
                "finished": opt.finished,
                "events": recorder.events,
                "lrs": sorted({g["lr"] for g in opt.param_groups}),
                "last_error": str(opt.last_error) if opt.last_error else None,
            },
            out,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
