#!/usr/bin/env python3
"""One rank of PyTorch's Gloo all-reduce, timed as `flotilla bench allreduce` and
../shared/peers/torch_allreduce.py time it (barrier, all_reduce, slowest rank, median), for
layouts that script does not start: ranks spread over hosts (benches/hierarchical_allreduce.sh
starts one per rank inside network namespaces). Rank 0 prints one JSON object per size.

    python gloo_allreduce_rank.py --rank R --world N --master HOST:PORT [--sizes-mib 1 16 64] [--iters 10]
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world)
    for mib in args.sizes_mib:
        tensor = torch.ones(int(mib * (1 << 20)) // 4, dtype=torch.float32)
        for _ in range(2):
            dist.all_reduce(tensor)
        times = []
        for _ in range(args.iters):
            tensor.fill_(1.0)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        if not bool(torch.all(tensor == args.world)):
            raise SystemExit(f"wrong sum at {mib} MiB")
        median = statistics.median(times)
        algbw = tensor.numel() * 4 / median / 1e9
        if args.rank == 0:
            print(json.dumps({
                "op": "allreduce", "peer": "gloo", "nproc": args.world, "bytes": tensor.numel() * 4,
                "median_s": median, "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (args.world - 1) / args.world,
            }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
