"""The relay's task broker: tensor work that callers post and outbound-only workers pull.

Volunteers cannot accept connections, so model-parallel work (Learning@home's experts, the
staged pipeline's micro-batches) goes through the relay: a caller posts a payload to a queue key,
a worker long-polls for the tasks of the keys it serves, computes, and pushes a result that the
relay hands back to the waiting caller. :mod:`.payload_store` keeps payloads (memory first, a byte budget,
spill to disk); :mod:`.broker` keeps the tasks (:mod:`.task`: idempotent call ids, per-key
backpressure, deadlines, dependencies between tasks, groups held until released, first result
wins, and what happens to a worker's tasks when it leaves or stalls); :mod:`.task_index` holds
them from submit until they are let go and finds them (by id, call id, key, group, worker);
:mod:`.queues` orders the queued ones (priority, then age, with affinity) and wakes only the
lease calls a task can serve; :mod:`.timing` measures each key's task time and derives its lease deadline. None knows HTTP nor
what the tensors mean: the routes that use them (``relay_server.moe``, the pipeline) validate
payloads against their own schema.

May import ``relay_server.core`` and the toolkit's shared layers only.
"""
