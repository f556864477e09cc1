"""Who is asking: the relay's signing key (:mod:`.relay_key`), Hugging Face identity and the
allowlist (:mod:`.identity`), short-lived access passes issued at login (:mod:`.access`), and the
verification of every signed request (:mod:`.verify`, with its middleware). May import
:mod:`relay_server.core` and ``toolkit.wire``."""
