"""The relay's HTTP surface, on top of everything else: the aiohttp app and its lifespan
(:mod:`.app`), request context shared by route modules (:mod:`.context`), shard-lease routes
(:mod:`.shards`), the run's tokenizer file (:mod:`.tokenizer`), the toolkit wheel notebooks install
(:mod:`.toolkit_dist`), per-user rate limits (:mod:`.ratelimit`), the moderation admin API and
CLI (:mod:`.moderation`), the process runner (:mod:`.server`) and the dashboard (``static/``)."""
