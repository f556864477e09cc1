"""Where a process runs, on either side: device detection as one ordered chain
(:mod:`.environment`: TPU, CUDA, MPS, CPU), the precision policy that follows from it
(:mod:`.precision`), whether ``bitsandbytes`` can keep 8-bit optimizer moments on a device
(:mod:`.eight_bit`: a local-SGD peer and the relay's master state ask), and a child process that
must not outlive its parent (:mod:`.parent`: peers' processes, the demo's peers). Imports only
``toolkit.errors``."""
