"""pytorch/examples distributed/ddp-tutorial-series/multigpu_torchrun.py, made
exactly resumable under jitrun with one call (``jitckpt.resumable``).

Upstream: https://github.com/pytorch/examples (BSD-3-Clause), with
MyTrainDataset from datautils.py inlined. Edits, each marked in the code:

* ``# CPU:`` runs on CPU: gloo instead of nccl, no ``.to(gpu_id)`` /
  ``device_ids``, no pinned memory;
* ``# test:`` makes a failure-free run reproducible and comparable: a fixed
  seed before the random dataset and model are made, MSELoss instead of
  CrossEntropyLoss (over a single output it is identically zero, so the weights
  would never change and any comparison would pass), SGD with momentum (an
  optimizer state to compare), ``--out`` for the final state;
* ``# jitckpt:`` the resumable part: the one call and the epoch counter it
  restores (README, "One call: jitckpt.resumable"). The tutorial's own
  epoch snapshots are kept: they survive the loss of the whole job, the JIT
  checkpoint (newer) wins after a failure.

    jitrun --standalone --nproc-per-node 2 scripts/examples/multigpu_torchrun.py 2 10
"""

import os

import torch
import torch.nn.functional as F  # noqa: N812 - upstream's import style
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import jitckpt  # jitckpt:


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")  # CPU: was "nccl"


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model  # CPU: was model.to(self.gpu_id)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)

        self.model = DDP(self.model)  # CPU: was DDP(self.model, device_ids=[self.gpu_id])
        # jitckpt: model, optimizer, data position, RNG and the epoch counter, restored after a failure
        self.progress = jitckpt.resumable(model=self.model, optimizer=self.optimizer,
                                          dataloader=self.train_data, state={"epoch": self.epochs_run})
        self.epochs_run = self.progress["epoch"]  # jitckpt:

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)  # test: was torch.nn.CrossEntropyLoss()(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        for source, targets in self.train_data:
            # CPU: no .to(self.gpu_id)
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {}
        snapshot["MODEL_STATE"] = self.model.module.state_dict()
        snapshot["EPOCHS_RUN"] = epoch
        torch.save(snapshot, "snapshot.pt")
        print(f"Epoch {epoch} | Training snapshot saved at snapshot.pt")

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self.progress["epoch"] = epoch  # jitckpt:
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    torch.manual_seed(0)  # test: the same dataset and initial weights in every run
    train_set = MyTrainDataset(2048)  # load your dataset
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)  # test: momentum added
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=False,  # CPU: was True
        shuffle=False,
        sampler=DistributedSampler(dataset)
    )


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str = "snapshot.pt",
         out: str | None = None):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    if out and int(os.environ["RANK"]) == 0:  # test: final state, compared bit for bit
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, out)
    destroy_process_group()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description='simple distributed training job')
    parser.add_argument('total_epochs', type=int, help='Total epochs to train the model')
    parser.add_argument('save_every', type=int, help='How often to save a snapshot')
    parser.add_argument('--batch_size', default=32, type=int,  # test: type=int (upstream keeps a string)
                        help='Input batch size on each device (default: 32)')
    parser.add_argument('--out', default=None, help='test: rank 0 writes the final model+optimizer state here')
    args = parser.parse_args()

    main(args.save_every, args.total_epochs, args.batch_size, out=args.out)
