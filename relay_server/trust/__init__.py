"""Trusting the work of stage workers, not only their signatures.

A pipeline result that is finite and well shaped may still be wrong (activations scaled, a
gradient's sign flipped, noise added): :mod:`relay_server.pipeline.results` cannot see it. This
package decides whether a result is right, and what follows when it is not:

* :mod:`.compare` -- how far two computations of one task may differ for the run's precision and
  boundary codec (the tolerance), and how far they do;
* :mod:`.monitor` -- cheap statistics of every result against its stage's running distribution,
  feeding a per-worker suspicion score;
* :mod:`.referee` -- the relay's own copy of a stage, which recomputes a task when a worker's
  result cannot be re-issued (a first-stage task reads the worker's own data) or when two
  workers disagree;
* :mod:`.shares` -- which results are checked: a per-worker share under the relay's secret (new
  workers on probation, suspects always, everyone else the run's base share);
* :mod:`.calibrate` -- the tolerance's measurement: honest recomputations against fp64, per
  precision;
* :mod:`.checks` -- spot checks: the chosen tasks re-issued to another worker of the stage as an
  ordinary task, compared, disputes refereed, liars banned;
* :mod:`.gradient_audit` -- audits of the stage gradients workers upload at a round (a sum no
  per-task check reaches): the referee computes a chosen upload's sum while it streams in, and a
  lie is refused before the reducer's commit point.

The pipeline's coordinator owns the hooks (where a result is accepted, where tasks are leased,
when a round may open); this package owns the decisions and their counters.

Expert hosts (DMoE) have their own two modules, over the same tolerance and monitor:

* :mod:`.expert_copy` -- the relay's own copy of an expert, at a version whose parameters it
  holds (the seed's, or a host's checkpoint);
* :mod:`.expert_checks` -- spot checks of a secret-seeded share of expert calls against that
  copy, a per-layer monitor, stale versions, liars banned; the DMoE call route owns the hooks.
"""
