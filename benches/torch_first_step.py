#!/usr/bin/env python3
"""The peer of `cargo bench --bench srun_first_step`: PyTorch DDP (Gloo) of the default job's
MLP (64-128-10, 64 rows a step over the ranks), started by torchrun; rank 0 writes the time of
its first finished step (seconds since the epoch) to --marker, then trains --steps steps.

    torchrun --nproc-per-node 2 benches/torch_first_step.py --marker FILE [--steps 200]
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marker", required=True)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rows = 64 // world
    for step in range(args.steps):
        x, y = torch.randn(rows, 64), torch.randint(0, 10, (rows,))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step == 0 and rank == 0:
            with open(args.marker + ".tmp", "w") as out:
                out.write(f"{time.time()}\n")
            os.replace(args.marker + ".tmp", args.marker)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
