"""The roles a peer plays through ``toolkit.join``, each a program with its own options.

Owns: :mod:`~toolkit.roles.options` (each role's options and the one-line refusal of one it does
not use), :mod:`~toolkit.roles.trainer`, :mod:`~toolkit.roles.stage_worker` and
:mod:`~toolkit.roles.expert_host` (what each role runs, from joining to leaving), and
:mod:`~toolkit.roles.result` (what a role did). ``toolkit.session.join`` picks the role; every role
is a member of the run through :mod:`toolkit.run_membership`. Sits above the optimizer, the pipeline,
the expert host and the notebook panel, which it drives; below ``toolkit.session``.
"""
