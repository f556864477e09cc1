"""Where a peer runs: device detection as one ordered chain (:mod:`.environment`: TPU, CUDA, MPS,
CPU), the precision policy that follows from it (:mod:`.precision`), and a child process that must
not outlive its parent (:mod:`.parent`). Imports only ``toolkit.errors``."""
