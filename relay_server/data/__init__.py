"""The data task pool: shards of the run's streamed datasets leased to peers, least-processed
first, expiring with heartbeats, persisted in SQLite (:mod:`.pool`). Its HTTP face needs the peer
registry and lives in :mod:`relay_server.api.shards`. Also the organizer's tokenizer training on
the run's own text (:mod:`.tokenizer_train`). May import :mod:`relay_server.core`."""
