"""What crosses the network, shared by peers and the relay: the validation layer (:mod:`.schema`),
every typed message and route (:mod:`.protocol`), tensors in a streamed safetensors container
(:mod:`.tensor_container`), the tensor messages built on it (:mod:`.payloads`: expert calls,
pipeline tasks and results, expert checkpoints), gradient and parameter codecs
(:mod:`.compression`) and the signed-request format (:mod:`.auth`); the learning-rate schedule
both sides compute (:mod:`.schedule`). Imports only ``toolkit.errors``; torch only where tensors
are built."""
