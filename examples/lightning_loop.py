"""A Lightning module on a collaborative run: python examples/lightning_loop.py http://relay:8750"""

import os
import sys

import lightning.pytorch as L

import toolkit
from toolkit import CollaborativeOptimizer
from toolkit.integrations.lightning import CollaborativeLightningCallback

RELAY_URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("RELAY_URL", "http://localhost:8750")

model = toolkit.run_model(RELAY_URL)
opt = CollaborativeOptimizer(model, RELAY_URL, batch_size_per_step=8)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return opt


trainer = L.Trainer(accumulate_grad_batches=2, callbacks=[CollaborativeLightningCallback()],
                    logger=False, enable_checkpointing=False)
trainer.fit(Module(), opt.batches())  # one pass over the run's data: it ends when the run finishes
opt.close()
