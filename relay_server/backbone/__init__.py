"""The vector sliced among servers: one slice's master + reducer + publisher (:mod:`.slice_owner`),
HMAC upload tickets (:mod:`.tickets`), moving parameters and optimizer state between owners
(:mod:`.state_transfer`), recovering a dead aggregator's slice (:mod:`.recovery`), the registry of
aggregators and their liveness (:mod:`.aggregators`), a slicing as data -- owners, manifests,
stitched state (:mod:`.slicing`) --, closing a sliced round across the owners, global-norm
clipping included (:mod:`.closing`), the relay-side coordinator deciding who owns what
(:mod:`.backbone`), the relay's link load per step it states in /api/plan (:mod:`.link_load`)
and the slice routes both the relay and aggregators serve (:mod:`.slice_routes`).
May import core, auth, rounds and planning."""
