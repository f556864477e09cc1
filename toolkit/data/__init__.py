"""Streaming training data: shards -> rows -> shuffle buffer -> mix -> tokens -> packed batches.

DeDLOC section 3.3 / Appendix I.4, with one change of seam (DESIGN.md s8):

* **Shards are files** (Parquet, JSON lines, text; optionally compressed), read one at a time
  with ``datasets`` streaming (:mod:`.reading`): the same code path for a local path and a Hub
  file, so a peer trains on its first rows while the rest are still unread.
* **Which shard next** comes from a :class:`ShardSource` (:mod:`.shards`). The default,
  :class:`LocalShardOrder`, is the paper's: every peer walks all shards in its own random order.
  :class:`RelayShardSource` leases shards from the relay's pool instead, so peers rarely
  duplicate work and a departed peer's shard returns to the pool; the stream reports, per shard,
  how many rows reached training and releases each shard when done.
* A **shuffle buffer** of S rows (paper: S = 10,000) per dataset, fed by the chained shards, so it
  mixes across shard boundaries; **mixing** several datasets by probability (sahajBERT: 0.23
  Wikipedia / 0.77 OSCAR); **tokenization** on the fly by a user callable ``text -> list[int]``,
  then **packing** into ``[batch, seq_len + 1]`` LongTensor batches (:mod:`.stream_ops`).
* The run's ``[dataset]`` section, typed (:mod:`.dataset_config`), and the assembled stream (:mod:`.stream`).
* The run's ``[objective]`` (:mod:`.objectives`): its tokenizer, packing into ``seq_len`` blocks,
  masked-LM / causal-LM / classification dict batches; a peer's input pipeline
  (:mod:`.input_pipeline`) runs it on a worker thread (:mod:`.background`).

All but :mod:`.input_pipeline` are in the shared layer (:mod:`toolkit`): the relay streams the
same text to train a tokenizer, evaluate and compute loss references. :mod:`.input_pipeline` leases
shards through the relay client, so it is a peer-side unit of its own.

``datasets`` reads ``HF_DATASETS_OFFLINE`` once, when it is first imported: set it before
anything imports ``datasets`` (it is imported lazily here, on the first shard read).

    from toolkit.data import batches_for_run, shard_sources_for_run
    batches = batches_for_run(run.dataset, batch_size=8, seq_len=64, seed=peer_id,
                              shard_source=shard_sources_for_run(run.dataset, client, peer_id))
"""

from toolkit.data.background import Background
from toolkit.data.dataset_config import DEFAULT_SHUFFLE_BUFFER, DatasetSpec, StreamConfig
from toolkit.data.objectives import ObjectiveConfig, load_tokenizer, objective_batches, tokenizer_sha256
from toolkit.data.reading import check_offline_env, infer_format, read_shard
from toolkit.data.shards import (
    LocalShardOrder,
    RelayShardSource,
    ShardLeaseClient,
    ShardSource,
    relay_shard_sources,
    shard_sources_for_run,
)
from toolkit.data.stream import ShardSourceFactory, batches_for_run, stream_batches, stream_texts
from toolkit.data.stream_ops import BYTE_EOS, Tokenizer, byte_tokenize, mix, pack, shuffle_buffer
from toolkit.errors import DataConfigError, DataSourceError

__all__ = [
    "BYTE_EOS",
    "Background",
    "DEFAULT_SHUFFLE_BUFFER",
    "ObjectiveConfig",
    "load_tokenizer",
    "objective_batches",
    "tokenizer_sha256",
    "DataConfigError",
    "DataSourceError",
    "DatasetSpec",
    "LocalShardOrder",
    "RelayShardSource",
    "ShardLeaseClient",
    "ShardSource",
    "ShardSourceFactory",
    "StreamConfig",
    "Tokenizer",
    "batches_for_run",
    "byte_tokenize",
    "check_offline_env",
    "infer_format",
    "mix",
    "pack",
    "read_shard",
    "relay_shard_sources",
    "shard_sources_for_run",
    "shuffle_buffer",
    "stream_batches",
    "stream_texts",
]
