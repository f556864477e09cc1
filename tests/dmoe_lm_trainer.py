"""A trainer of a DMoE language-model run, as a real process: ``toolkit.join`` on fixed batches.

``python tests/dmoe_lm_trainer.py URL STEPS TOKENIZER`` builds the run's model (a
:class:`~toolkit.models.DMoEByteLM`, from the run's spec, as ``join`` does) and trains it on
:func:`lm_batches` -- the run's causal-LM objective over the text the toolkit ships, tokenized
with TOKENIZER (the run's ``tokenizer.json``), so the test's in-process reference sees the same
batches -- and prints one JSON line: the result and each mixture's call counters.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCH, SEQ_LEN = 4, 16


def lm_batches(tokenizer: Path, steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` causal-LM dict batches of the shipped text (``input_ids``, ``attention_mask``, ``labels``)."""
    from toolkit.corpus import demo_texts
    from toolkit.data.objectives import ObjectiveConfig, load_tokenizer, objective_batches

    objective = ObjectiveConfig.from_dict({"name": "causal-lm", "seq_len": SEQ_LEN})
    stream = objective_batches(
        demo_texts(0), load_tokenizer(tokenizer.read_bytes()), objective, batch_size=BATCH, seed=0
    )
    return list(itertools.islice(stream, steps))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("steps", type=int)
    parser.add_argument("tokenizer", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from toolkit import join
    from toolkit.client import RelayClient
    from toolkit.models import build_model

    model = build_model(RelayClient(args.url).get_run().model)  # the relay's parameters replace its values
    result = join(
        args.url,
        model=model,
        data=lm_batches(args.tokenizer, args.steps),
        batch_size=BATCH,
        max_steps=args.steps,
        panel="none",
        peer_name="lm-trainer",
    )
    stats = [
        dict(
            calls=m.stats.calls,
            failures=m.stats.failures,
            backward_failures=m.stats.backward_failures,
            dropped_rows=m.stats.dropped_rows,
        )
        for m in model.moe
    ]
    print(
        json.dumps({"final_step": result.final_step, "local_steps": result.local_steps, "layers": stats}), flush=True
    )
    return 0


if __name__ == "__main__":
    # What it wrote is closed or flushed below: skip the interpreter's teardown of torch (~0.6 s of
    # CPU a process, and the suite starts hundreds of them).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
