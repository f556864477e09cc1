"""The training loops people already use, around CollaborativeOptimizer, on a real relay.

The optimizer as a torch.optim.Optimizer citizen (state_dict round trip, the relay's lr in its
param groups, an LR scheduler that changes nothing the relay decides, losses noted by loops that
call step() bare), the run's pinned precision taken by itself, and the notes of watched losses
(eval mode, a skipped step). The four loops themselves, exact under accumulation and fp16, are
tests/test_loop_exactness.py; the snippets of docs/models.md, tests/test_examples.py.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toolkit.errors import PrecisionUnsupported
from toolkit.integrations import watch_loss
from toolkit.models import build_model
from toolkit.optimizer import CollaborativeOptimizer

REPO = Path(__file__).resolve().parent.parent
GPT2_TINY = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32}


def mlp_batch(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return torch.cat([x, x.sum(1, keepdim=True).tanh()], dim=1)


def test_optimizer_is_a_torch_optimizer_citizen(serve_relay):
    # Warmup makes the relay's lr depend on the step: 0.02 * (step + 1) / 10.
    relay = serve_relay(
        {"run": {"target_batch": 8}, "optimizer": {"lr": 0.02, "warmup_steps": 10, "schedule": "constant"}}
    )
    client_model = build_model(_mlp_spec())
    with CollaborativeOptimizer(client_model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as opt:
        assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.002)]
        assert not opt.state  # torch's per-parameter state: empty, never the collaboration's

        # state_dict round trip, through torch.save as Trainer/Accelerate/Lightning checkpoints do
        saved = io.BytesIO()
        torch.save(opt.state_dict(), saved)
        loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
        loaded["param_groups"][0]["lr"] = 123.0
        opt.load_state_dict(loaded)
        assert opt.param_groups[0]["lr"] == 123.0 and len(opt.param_groups[0]["params"]) == 4
        assert opt.state_dict()["param_groups"][0]["params"] == loaded["param_groups"][0]["params"]
        opt.report_progress()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.002)  # the relay's lr wins at the next sync

        # A torch LR scheduler may write the groups' lr; training goes on, the relay's value returns.
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
        # Losses noted by a loop that calls step() bare: averaged by size, their sizes summed.
        while opt.version < 1:
            batch = mlp_batch(8, seed=opt.version)
            opt.zero_grad()
            client_model.loss(batch).backward()
            opt.note_loss(torch.tensor(2.0), 4)
            opt.note_loss(4.0, 4)
            opt.step()
            scheduler.step()
            assert opt.param_groups[0]["lr"] == pytest.approx(scheduler.get_last_lr()[0])  # the scheduler's, for now
        opt.report_progress()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.004) and opt.contributed_samples == 8
    record = next(r for r in relay.status()["recent_rounds"] if r["step"] == 1)
    assert record["samples"] == 8 and record["loss"] == pytest.approx(3.0)


@pytest.mark.integration
def test_toolkit_imports_without_the_loop_packages():
    code = (
        "import sys\n"
        "for name in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning'):\n"
        "    sys.modules[name] = None\n"
        "import toolkit, toolkit.optimizer, toolkit.integrations, toolkit.session\n"
        "try:\n    import toolkit.integrations.hf_trainer\nexcept ImportError as e:\n    print('hf:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "collabtrain[hf]" in done.stdout


class LossOf(torch.nn.Module):
    """A module whose forward returns the MLP's loss (``watch_loss(..., scalar_output=True)``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model.loss(batch)


def test_optimizer_takes_the_runs_pinned_precision_and_refuses_another(serve_relay):
    relay = serve_relay({"run": {"target_batch": 8, "precision": "fp32"}})
    model = build_model(_mlp_spec())
    with CollaborativeOptimizer(model, relay.url, batch_size_per_step=4) as opt:
        assert opt.precision == "fp32"
    with pytest.raises(PrecisionUnsupported) as refused:
        CollaborativeOptimizer(model, relay.url, batch_size_per_step=4, precision="bf16")
    assert "fp32 only" in refused.value.message and "precision='fp32'" in refused.value.hint
    assert "leave precision out" in refused.value.hint


def test_contribute_adds_handed_in_gradients_exactly_and_drops_a_stale_one_saying_so(serve_relay):
    """contribute() is step()'s path with the gradients handed in, as a trainer with micro-batches
    in flight on replicas does (toolkit.moe.inflight): one computed on the current version makes
    the exact SGD update; one computed before the version just loaded, in a run allowing no
    staleness, could join no round: it is dropped, counted, and named on the panel."""
    from toolkit.notebook.panel import PeerProgress

    relay = serve_relay(
        {
            "run": {"target_batch": 4, "max_staleness": 0},
            "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0, "schedule": "constant"},
        }
    )
    model = build_model(_mlp_spec())
    with CollaborativeOptimizer(model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as opt:
        joined_at = opt.version
        replica = build_model(_mlp_spec())
        replica.load_state_dict(model.state_dict())
        before = [p.detach().clone() for p in model.parameters()]
        batch = mlp_batch(4, seed=3)
        loss = replica.loss(batch)
        loss.backward()
        grads = [p.grad for p in replica.parameters()]
        assert opt.contribute(grads, batch_size=4, loss=loss.item(), version=joined_at)
        assert opt.version == joined_at + 1 and opt.contributed_samples == 4  # the round ran within it
        with torch.no_grad():
            for p, b, g in zip(model.parameters(), before, grads):
                torch.testing.assert_close(p, b - 0.1 * g, rtol=1e-5, atol=1e-6)
        assert not opt.contribute(grads, batch_size=4, loss=loss.item(), version=joined_at)
        assert opt.dropped_stale_samples == 4 and opt.samples == 0 and opt.last_error.code == "stale_gradient"
        shown = PeerProgress.from_optimizer(opt, loss=None, first_contribution_s=None).problem
        assert "dropped a micro-batch of 4 samples computed on step" in shown, shown


def test_watched_loss_in_eval_mode_counts_and_a_skipped_steps_notes_do_not_leak(serve_relay):
    """A model in eval() mode (as from_pretrained returns it) still has its loss noted when it is
    trained; the micro-batch of a step a scaler skipped (gradients zeroed, no step) counts
    nothing: the round holds exactly the next micro-batch's samples, gradient and loss."""
    relay = serve_relay(
        {
            "run": {"target_batch": 4},
            "optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.0, "schedule": "constant"},
        }
    )
    model = build_model(_mlp_spec())
    wrapped = LossOf(model).eval()
    with CollaborativeOptimizer(model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as opt:
        handle = watch_loss(wrapped, opt, scalar_output=True)
        before = [p.detach().clone() for p in model.parameters()]
        skipped = mlp_batch(4, seed=1) * 100.0  # its loss and gradient would be far off
        wrapped(skipped).backward()
        opt.zero_grad()  # what a loop does after a GradScaler skipped step()
        batch = mlp_batch(4, seed=2)
        loss = wrapped(batch)
        loss.backward()
        opt.step()  # its samples reach the target: the round runs within this step
        handle.remove()
        assert opt.version == 1 and opt.contributed_samples == 4
    record = next(r for r in relay.status()["recent_rounds"] if r["step"] == 1)
    assert record["samples"] == 4 and record["loss"] == pytest.approx(loss.item(), rel=1e-6)
    reference = build_model(_mlp_spec())
    with torch.no_grad():
        for p, b in zip(reference.parameters(), before):
            p.copy_(b)
    reference.loss(batch).backward()
    with torch.no_grad():
        for p, b, r in zip(model.parameters(), before, reference.parameters()):
            torch.testing.assert_close(p, b - 0.1 * r.grad, rtol=1e-5, atol=1e-6)


def test_trainer_logs_the_relays_learning_rate(serve_relay, tmp_path):
    """The Trainer's own scheduler would log the relay's first lr forever; the callback makes it
    report the relay's (warmup: 0.02 * (version + 1) / 10)."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    import toolkit
    from toolkit.integrations.hf_trainer import CollaborativeCallback

    relay = serve_relay(
        {
            "run": {"target_batch": 4, "total_steps": 4},
            "model": {"kind": "transformers", "architecture": "AutoModelForCausalLM", "config": GPT2_TINY},
            "optimizer": {"name": "sgd", "lr": 0.02, "warmup_steps": 10, "weight_decay": 0.0, "schedule": "constant"},
        }
    )
    model = toolkit.run_model(relay.url)
    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    with CollaborativeOptimizer(model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as opt:
        args = TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=100,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=[{"input_ids": r, "labels": r} for r in ids],
            optimizers=(opt, None),
            callbacks=[CollaborativeCallback(opt)],
        )
        trainer.train()
        assert opt.finished and trainer.args.max_grad_norm == 0.0  # per-peer clipping turned off
    logged = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    relay_lrs = [0.002 * (version + 1) for version in range(5)]  # the relay's lr at each version
    assert all(any(lr == pytest.approx(r) for r in relay_lrs) for lr in logged), logged
    assert logged == sorted(logged) and len(set(logged)) >= 3, logged  # it follows the relay, not frozen


def _mlp_spec():
    from toolkit.wire.protocol import ModelSpec

    return ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": [8, 16, 1]})


def test_a_loss_scaled_by_a_scaler_the_optimizer_was_not_given_is_refused_in_one_sentence():
    """A watched loop whose GradScaler the optimizer does not know would send its gradient times
    the scale: the step says which scaler to pass instead."""
    from toolkit.optim_base import LossNotes

    weight = torch.nn.Parameter(torch.ones(3))
    notes = LossNotes()
    loss = (weight * 2.0).mean()
    notes.add(loss, 4, unit=4.0)
    (loss * 2.0**16).backward()
    with pytest.raises(ValueError, match=r"multiplied by 65536.*scaler=scaler") as refused:
        notes.take()
    assert "\n" not in str(refused.value)


def _finished_run(serve_relay):
    """A relay whose run ended at step 1, finished by a plain loop; the run's model, and data."""
    import toolkit

    relay = serve_relay(
        {
            "run": {"target_batch": 4, "total_steps": 1},
            "model": {"kind": "transformers", "architecture": "AutoModelForCausalLM", "config": GPT2_TINY},
            "optimizer": {"name": "sgd", "lr": 0.02, "weight_decay": 0.0},
        }
    )
    model = toolkit.run_model(relay.url)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    with CollaborativeOptimizer(model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as first:
        while not first.finished:
            model(input_ids=ids, labels=ids).loss.backward()
            first.step(loss=0.0, batch_size=4)
    return relay, toolkit.run_model(relay.url), [{"input_ids": ids, "labels": ids}]


FINISHED = (
    "[run_finished] run 'test-run' already finished at step 1: there is nothing left to contribute -- "
    "Nothing to do here: ask the organizer for the address of their next run."
)


@pytest.mark.integration
def test_a_trainer_joining_a_finished_run_ends_saying_so(serve_relay, tmp_path):
    """The HF Trainer on a finished run's (empty) run_dataset used to crash inside Accelerate
    ("Batch does not contain any data"); it ends with join()'s one line instead, before any step."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from toolkit.errors import RunFinished
    from toolkit.integrations.hf_trainer import CollaborativeCallback, run_dataset

    relay, model, data = _finished_run(serve_relay)
    with CollaborativeOptimizer(model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as opt:
        assert opt.finished
        args = TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=10,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=run_dataset(opt, data),
            optimizers=(opt, None),
            callbacks=[CollaborativeCallback(opt)],
        )
        with pytest.raises(RunFinished) as ended:
            trainer.train()
    assert str(ended.value) == FINISHED
    assert trainer.state.global_step == 0 and opt.version == 1


@pytest.mark.integration
def test_a_lightning_trainer_joining_a_finished_run_ends_saying_so(serve_relay):
    """Lightning on a finished run's (empty) opt.batches() used to train 0 steps without a word."""
    pl = pytest.importorskip("lightning.pytorch")

    from toolkit.errors import RunFinished
    from toolkit.integrations.lightning import CollaborativeLightningCallback

    relay, model, data = _finished_run(serve_relay)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return opt

    with CollaborativeOptimizer(model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as opt:
        trainer = pl.Trainer(
            max_steps=10,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[CollaborativeLightningCallback()],
        )
        with pytest.raises(RunFinished) as ended:
            trainer.fit(Module(), opt.batches(data))
    assert str(ended.value) == FINISHED
    assert trainer.global_step == 0 and opt.version == 1


@pytest.mark.integration
def test_an_accelerate_loop_joining_a_finished_run_ends_saying_so(serve_relay):
    """An Accelerate loop over a finished run's (empty) opt.batches() used to train nothing without
    a word; watch_loss, its one call into the integrations, says the run is over."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from toolkit.errors import RunFinished

    relay, model, _ = _finished_run(serve_relay)
    with CollaborativeOptimizer(model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as opt:
        model, wrapped = Accelerator(cpu=True).prepare(model, opt)
        with pytest.raises(RunFinished) as ended:
            watch_loss(model, wrapped)
    assert str(ended.value) == FINISHED
    assert opt.version == 1
