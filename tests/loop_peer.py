"""A real peer process that trains the run's tiny GPT-2 through one of the loops people use:
``--loop plain|trainer|accelerate|lightning``, each with the real CollaborativeOptimizer and the
integration from :mod:`toolkit.integrations`. It trains until the run finishes (``finished`` in
the relay's state stops every loop) and writes one JSON line at the end: what it contributed, the
losses it computed and the learning rates its optimizer's param groups showed."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time

import torch

VOCAB, SEQ = 64, 16
MAX_LOCAL_STEPS = 5000  # a safety net: the run's end stops every loop long before


class TokenData(torch.utils.data.Dataset):
    """Learnable random sequences: a random start, then steps of a random stride (1..3) mod VOCAB."""

    def __init__(self, seed: int, n: int = 4096) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def loader(data: TokenData, batch_size: int, seed: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True,
                                       generator=torch.Generator().manual_seed(seed))


def forever(data: TokenData, batch_size: int, seed: int):
    while True:
        yield from loader(data, batch_size, seed)
        seed += 1


def run_plain(model, opt, data, args, note) -> None:
    for batch in forever(data, args.batch_size, args.seed):
        if opt.finished:
            return
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        note(loss.item())
        opt.step(loss=loss.item(), batch_size=args.batch_size)


def run_trainer(model, opt, data, args, note) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from toolkit.integrations.hf import CollaborativeCallback

    class Record(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            note(None)  # after the Trainer's scheduler stepped and the callback restored the relay's lr

    model.register_forward_hook(lambda module, inputs, out: note(out.loss.item()) if module.training else None)

    targs = TrainingArguments(output_dir=args.workdir, per_device_train_batch_size=args.batch_size,
                              max_steps=MAX_LOCAL_STEPS, max_grad_norm=0.0, report_to=[], save_strategy="no",
                              logging_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
                              seed=args.seed)
    trainer = Trainer(model=model, args=targs, train_dataset=data, optimizers=(opt, None),
                      callbacks=[CollaborativeCallback(opt), Record()])
    trainer.train()


def run_accelerate(model, opt, data, args, note) -> None:
    from accelerate import Accelerator

    from toolkit.integrations import watch_loss

    accelerator = Accelerator(cpu=True)
    model, wrapped, batches = accelerator.prepare(model, opt, loader(data, args.batch_size, args.seed))
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    handle = watch_loss(model, wrapped)
    for _ in range(MAX_LOCAL_STEPS):
        for batch in batches:
            if opt.finished:
                handle.remove()
                return
            loss = model(**batch).loss
            accelerator.backward(loss)
            wrapped.step()  # reaches CollaborativeOptimizer.step with the loss the hook noted
            wrapped.zero_grad()
            note(loss.item())


def run_lightning(model, opt, data, args, note) -> None:
    import lightning.pytorch as pl

    from toolkit.integrations.lightning import CollaborativeLightningCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            note(loss.item())
            return loss

        def configure_optimizers(self):
            return opt

    trainer = pl.Trainer(max_steps=MAX_LOCAL_STEPS, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[CollaborativeLightningCallback()])
    trainer.fit(Module(), loader(data, args.batch_size, args.seed))


LOOPS = {"plain": run_plain, "trainer": run_trainer, "accelerate": run_accelerate, "lightning": run_lightning}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--relay", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--loop", choices=sorted(LOOPS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--wait-peers", type=int, default=0, help="start computing once this many peers joined")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    torch.set_num_threads(1)

    from toolkit.client import RelayClient
    from toolkit.models import build_model
    from toolkit.optimizer import CollaborativeOptimizer

    if args.loop == "trainer":  # pay the loop's imports before joining, so peers start together
        import transformers.trainer  # noqa: F401
    elif args.loop == "accelerate":
        import accelerate  # noqa: F401
    elif args.loop == "lightning":
        import lightning.pytorch  # noqa: F401
    client = RelayClient(args.relay, retries=6, backoff_s=0.3)
    model = build_model(client.get_run().model)
    model.train()
    opt = CollaborativeOptimizer(model, client=client, batch_size_per_step=args.batch_size, peer_name=args.name,
                                 report_interval_s=0.05)
    losses: list[float] = []
    uploads: list[tuple[int, float]] = []  # (samples, loss_sum) of every gradient this peer sent
    take = opt.accumulator.take

    def recording_take(*a, **kw):
        meta, grad = take(*a, **kw)
        uploads.append((meta.samples, meta.loss_sum))
        return meta, grad

    opt.accumulator.take = recording_take
    lrs: set[float] = {opt.param_groups[0]["lr"]}

    def note(loss: float | None) -> None:
        if loss is not None:
            losses.append(loss)
        lrs.add(opt.param_groups[0]["lr"])

    while args.wait_peers and client.get_status().num_peers < args.wait_peers:
        time.sleep(0.05)
    try:
        LOOPS[args.loop](model, opt, TokenData(args.seed), args, note)
    except KeyboardInterrupt:
        pass
    finally:
        opt.close()
    with open(args.result, "w") as out:
        json.dump({"loop": args.loop, "contributed_samples": opt.contributed_samples, "version": opt.version,
                   "finished": opt.finished, "losses": losses, "lrs": sorted(lrs), "uploads": uploads,
                   "last_error": str(opt.last_error) if opt.last_error else None}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
