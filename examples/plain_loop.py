"""A plain PyTorch loop on a collaborative run: python examples/plain_loop.py http://relay:8750"""

import os
import sys

import toolkit
from toolkit import CollaborativeOptimizer

RELAY_URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("RELAY_URL", "http://localhost:8750")

model = toolkit.run_model(RELAY_URL)  # the run's model, built from its config
model.train()
opt = CollaborativeOptimizer(model, RELAY_URL, batch_size_per_step=8)  # trains in the run's precision
for batch in opt.batches():  # the run's data for this peer; ends when the run finishes
    opt.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    opt.step(loss=loss.item(), batch_size=len(batch["input_ids"]))
opt.close()
