"""The relay's HTTP surface, on top of everything else: the aiohttp app and its lifespan
(:mod:`.app`), the features it plugs in (:mod:`.feature` says what one gives the app; DMoE
:mod:`.experts`, the pipeline :mod:`.pipeline`, evaluation :mod:`.evaluation` each export one),
request context shared by route modules (:mod:`.context`), shard-lease routes
(:mod:`.shards`), the run's tokenizer file (:mod:`.tokenizer`), the toolkit wheel notebooks install
(:mod:`.toolkit_dist`), per-user rate limits (:mod:`.ratelimit`), the moderation admin API and
CLI (:mod:`.moderation`), the process runner (:mod:`.server`) and the dashboard (``static/``)."""
