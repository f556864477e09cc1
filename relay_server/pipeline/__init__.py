"""The staged pipeline on the relay, the feature's folder (the heterogeneous-pipeline paper, seed 004, on our star).

The model is cut into stages, contiguous tensor-aligned ranges of its layers (the flat vector's
``[start, end)`` per stage); volunteers run stages; the relay holds every stage boundary and one
parameter server per stage. What lives where:

* :mod:`.boundaries` -- activations, their gradients and each micro-batch's data, held until the
  batch's round closes (a byte budget, spilled to disk beyond it);
* :mod:`.ledger` -- the batch and its micro-batches as a state machine: which task comes next,
  who holds which stage's gradient of which micro-batch, when the batch is complete (exactly once);
* :mod:`.in_flight` -- the batches in flight (two with delayed parameter updates) and the version
  each computes on;
* :mod:`.results` -- validating what workers send (shapes, codecs, finite values) before use;
* :mod:`.stage_owners` -- one :class:`~relay_server.backbone.slice_owner.SliceOwner` per stage:
  ticketed uploads, the optimizer step, the published manifest;
* :mod:`.coordinator` -- the task pool on the broker (1F1B order, affinity, measured lease
  deadlines, re-dispatch), rounds; beside it :mod:`.task_pool` (which step each task computes),
  :mod:`.task_results` (a result on arrival), :mod:`.worker_moves` (rebalancing, empty stages,
  silent workers) and :mod:`.trust_hooks` (the checks, and what a ban restarts) with :mod:`.rollback` (what a late ban undoes) and :mod:`.kept_inputs` (the
  first-stage data it replays); :mod:`.workers` which worker runs which stage; :mod:`.model_cut`
  the run's model cut into stages; :mod:`.status` what ``/api/pipeline`` reports; :mod:`.service`
  the whole built from the config and the collaboration's services, ticked, publishing each
  batch's step through the relay's after-publish sequence;
* the planner, pure computation (no I/O, no torch): :mod:`.star_model` / :mod:`.star` what the
  paper's planning reduces to in our outbound-only star (the paper's general planning, its time
  model, stage ordering and partition search, is reproduced in ``research.hetero_pipeline``,
  which the relay does not run).

The feature's folder: its config section and checks (:mod:`.pipeline_config`, ``[pipeline]``)
and its routes with the ``FEATURE`` the app plugs in (:mod:`.feature`) are two units of their
own (``relay_server/__init__.py`` lists them): the section imports nothing of the relay, the
routes sit over the app's feature contract. The rest may import core, auth, tasks, rounds,
planning, backbone and collaboration.
"""
