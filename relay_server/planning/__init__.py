"""Who computes and who aggregates which slice: DeDLOC's linear program (:mod:`.planner`, on
:mod:`.problem`, :mod:`.averaging_plan`, :mod:`.highs` and :mod:`.round_time`), the transfer and
compute rates it is solved from (:mod:`.measure`) and when to solve it again (:mod:`.policy`).
Pure computation plus :mod:`relay_server.core`'s config; no HTTP, no torch.

Appendix C's group size is not here: it sizes peer-to-peer all-reduce groups, which the relay's
star topology does not have; its reproduction of Figure 8 lives in ``research/dedloc_group_size.py``."""
