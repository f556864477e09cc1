"""The relay's HTTP surface, on top of everything else: the aiohttp app and its lifespan
(:mod:`.app`), the features it plugs in (:mod:`.feature` says what one gives the app; each
feature's folder exports one: DMoE :mod:`relay_server.moe.feature`, the pipeline :mod:`relay_server.pipeline.feature`,
local SGD :mod:`relay_server.local_sgd.feature`, evaluation :mod:`relay_server.evaluation.feature`),
request context shared by route modules (:mod:`.context`), shard-lease routes
(:mod:`.shards`), the run's tokenizer file (:mod:`.tokenizer`), the toolkit wheel notebooks install
(:mod:`.toolkit_dist`), per-user rate limits (:mod:`.ratelimit`), the moderation admin API and
CLI (:mod:`.moderation`), the process runner (:mod:`.server`) and the dashboard (``static/``)."""
