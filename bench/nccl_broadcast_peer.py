"""The raw NCCL limit for weight_sync.py: broadcast N bytes from GPU 0 to GPU 1, two processes.

Prints the median seconds of `--repeats` broadcasts (after one warm-up) as its last line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, nbytes: int, repeats: int, port: int, out: mp.Queue) -> None:
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    queue: mp.Queue = mp.get_context("spawn").Queue()
    port = 29000 + os.getpid() % 1000
    mp.spawn(run, args=(args.nbytes, args.repeats, port, queue), nprocs=2)
    print(queue.get())
