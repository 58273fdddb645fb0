"""One task of an srun step started as the launcher starts a megatron trainer: joins the job through
``collectives.init_from_environment`` (gloo) from srun's variables alone and prints what it became, one JSON line."""

from __future__ import annotations

import json
import os

import torch

from nemo_factuality.trainers.backends.collectives import init_from_environment

init_from_environment("cpu", 60.0)
ranks = torch.tensor([float(os.environ["RANK"])])
torch.distributed.all_reduce(ranks)  # every task in one group: the sum of 0..world-1
print(json.dumps({"rank": torch.distributed.get_rank(), "world": torch.distributed.get_world_size(),
                  "local_rank": int(os.environ["LOCAL_RANK"]), "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
                  "slurm_procid": int(os.environ["SLURM_PROCID"]), "rank_sum": ranks.item()}), flush=True)
torch.distributed.destroy_process_group()
