"""``CollaborativeOptimizer``: a training loop's ``zero_grad / backward / step``, collaboratively.

Epochs, DeDLOC style: every peer accumulates gradients at its own pace; once the collaboration
as a whole has ``target_batch`` samples, each peer uploads its accumulated gradient *sum*, the
relay averages them (weighted by samples) and applies the run's optimizer to the master
parameters, and every peer downloads the new parameters. Peers hold no optimizer state: the
backbone does (DESIGN.md s3), so joining late or after a crash just means downloading the
current parameters.

    model = toolkit.run_model("http://relay:8750")
    opt = CollaborativeOptimizer(model, "http://relay:8750", batch_size_per_step=16)
    for batch in opt.batches():              # the run's data; ends when the run finishes
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step(loss=loss.item())           # returns at once unless a round is due

What you will see in the log (``verbose=True``): "joined at step N" once; "round S: sent K
samples" when this peer contributes; "step S+1 loaded" when new parameters arrive; "behind:
resyncing" when this peer fell more than ``max_staleness`` versions behind (its unsent
gradient is discarded, by the rule in :mod:`toolkit.wire.protocol`).

``delayed_updates=True`` (DeDLOC's delayed parameter updates) runs the round in the background
thread while the next batches compute on the previous parameters: one step of staleness, which
the relay must allow (``run.max_staleness >= 1``). With it off, ``step()`` blocks for the round,
and training is exactly large-batch training.

A trainer that computes several micro-batches at once on replicas of the model (a run with
mixture layers, :mod:`toolkit.moe.inflight`) hands each one's gradients to ``contribute(grads,
batch_size=, loss=, version=)``, the method ``step()`` itself calls with ``.grad``; ``room()`` says
how many samples the collaboration may still gather before the round.

The package, one object per owner of state (each reaches the others through public methods, as
hivemind's Optimizer is made of its ProgressTracker and averagers): :mod:`.core` (the loop API:
the accumulator, the reports, the worker, leaving), :mod:`.participation` (``opt.rounds``: taking part
in a round, the public copy of the parameters and the version loaded), :mod:`.local_sgd`
(``opt.local_sgd``, ``run.mode = "local_sgd"``: the inner loop and the outer round), :mod:`.inner`
(its inner optimizer), :mod:`.overlap` (``opt.local_sgd.flight``: that round behind the next inner
steps), :mod:`.own_loop` (the run's model and data for a loop of one's own).
"""

from toolkit.optimizer.core import CollaborativeOptimizer
from toolkit.optimizer.own_loop import run_model

__all__ = ["CollaborativeOptimizer", "run_model"]
