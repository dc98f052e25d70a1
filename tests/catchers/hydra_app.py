"""@hydra.main around the shared training (core.py), as pytorch/examples'
minGPT-ddp runs: Hydra catches whatever the job raises, prints "Error
executing job with overrides" and exits 1.

    jitrun --nproc-per-node 2 hydra_app.py +out=final.pt +epochs=3
"""

from __future__ import annotations

import hydra
from core import train
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path=None)
def main(cfg: DictConfig) -> None:
    train(str(cfg.out), int(cfg.epochs))


if __name__ == "__main__":
    main()
