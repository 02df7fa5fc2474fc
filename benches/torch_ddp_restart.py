"""torch_ddp_restart.py -- the peer of benches/fault_recovery.sh: PyTorch DDP (Gloo) training of
the same MLP under `torchrun --max-restarts`, checkpointing every few steps; after a worker is
killed, torchrun stops the others and restarts them all, and each loads the newest checkpoint.

Run by torchrun, one process per rank:
    torchrun --nproc-per-node 3 --max-restarts 1 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:PORT benches/torch_ddp_restart.py --dir DIR

Prints, with the host's wall clock (seconds since the epoch):
    CHECKPOINT step=S t=T          rank 0, once step S's checkpoint is on disk
    RESTORED rank=R step=S t=T     each rank, once it holds the checkpoint's state (or step 0)
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def model(inputs: int, hidden: list[int], classes: int) -> nn.Module:
    layers: list[nn.Module] = []
    width = inputs
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 4096, 4096])
    parser.add_argument("--batch", type=int, default=48)
    args = parser.parse_args()

    # The agent's store outlives a restart; each round keys its rendezvous by the restart count,
    # or Gloo's new workers would try the dead round's addresses.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False)
    round_store = dist.PrefixStore(f"round-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)
    dist.init_process_group("gloo", store=round_store, rank=rank, world_size=world)
    torch.manual_seed(42)
    net = nn.parallel.DistributedDataParallel(model(64, args.hidden, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(args.dir, "checkpoint.pt")
    first = 0
    if os.path.exists(path):
        state = torch.load(path, map_location="cpu")
        net.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["step"]
    print(f"RESTORED rank={rank} step={first} t={time.time():.6f}", flush=True)

    generator = torch.Generator().manual_seed(7 + rank)
    per_rank = args.batch // world
    for step in range(first, args.steps):
        x = torch.randn(per_rank, 64, generator=generator)
        y = torch.randint(0, 10, (per_rank,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        done = step + 1
        if done % args.every == 0 and done < args.steps:
            if rank == 0:
                state = {"model": net.module.state_dict(), "optimizer": optimizer.state_dict(), "step": done}
                torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)
                print(f"CHECKPOINT step={done} t={time.time():.6f}", flush=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
