"""The HF Trainer on a collaborative run: python examples/hf_trainer.py http://relay:8750"""

import os
import sys

from transformers import Trainer, TrainingArguments

import toolkit
from toolkit import CollaborativeOptimizer
from toolkit.integrations.hf_trainer import CollaborativeCallback, run_dataset

RELAY_URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("RELAY_URL", "http://localhost:8750")

model = toolkit.run_model(RELAY_URL)
opt = CollaborativeOptimizer(model, RELAY_URL, batch_size_per_step=8)
args = TrainingArguments(output_dir="trainer-out", per_device_train_batch_size=8, gradient_accumulation_steps=2,
                         max_steps=100_000, report_to=[], save_strategy="no")
trainer = Trainer(model=model, args=args, train_dataset=run_dataset(opt), optimizers=(opt, None),
                  callbacks=[CollaborativeCallback(opt)])  # ends the Trainer when the run finishes
trainer.train()
opt.close()
