"""An Accelerate loop on a collaborative run: python examples/accelerate_loop.py http://relay:8750"""

import os
import sys

from accelerate import Accelerator

import toolkit
from toolkit import CollaborativeOptimizer
from toolkit.integrations import watch_loss

RELAY_URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("RELAY_URL", "http://localhost:8750")

accelerator = Accelerator(gradient_accumulation_steps=2)
model = toolkit.run_model(RELAY_URL)
opt = CollaborativeOptimizer(model, RELAY_URL, batch_size_per_step=8)
batches = opt.batches()  # ends when the run finishes, whatever wraps the optimizer
model, wrapped = accelerator.prepare(model, opt)
watch_loss(model, wrapped)  # each micro-batch's loss and size reach the relay
model.train()
for batch in batches:
    with accelerator.accumulate(model):
        loss = model(**{k: v.to(accelerator.device) for k, v in batch.items()}).loss
        accelerator.backward(loss)
        wrapped.step()
        wrapped.zero_grad()
opt.close()
