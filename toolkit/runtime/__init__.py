"""Where a peer runs: device detection as one ordered chain (:mod:`.environment`: TPU, CUDA, MPS,
CPU) and the precision policy that follows from it (:mod:`.precision`). Imports only
``toolkit.errors``."""
