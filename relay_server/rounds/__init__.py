"""One averaging round and what it produces: the peer registry (:mod:`.peer_registry`), a round's
membership and adaptive deadline (:mod:`.membership`), the streaming float32 reduction on its own
thread (:mod:`.reducer`, CenteredClip in :mod:`.robust`), master parameters and optimizer state
(:mod:`.master`, 8-bit state in :mod:`.optim8bit`), versions written once and served by sendfile
(:mod:`.publisher`) and what survives a restart (:mod:`.store`). May import :mod:`relay_server.core`
and :mod:`relay_server.auth` (versions are signed)."""
