"""Who computes and who aggregates which slice: DeDLOC's linear program (:mod:`.planner`),
Appendix C's group size under failures (:mod:`.group_size`), the transfer and compute rates it is
solved from (:mod:`.measure`) and when to solve it again (:mod:`.policy`). Pure computation plus
:mod:`relay_server.core`'s config; no HTTP, no torch."""
