"""A torch.distributed group for weight updates, separate from any default group.

Trainer rank 0 (rank 0 of this group) and every engine rank (`rank_offset + tp_rank`) call
`join_group` with the same address, port, world size and name; it returns once all have joined
(or raises after `timeout`). The rendezvous is a TCP store hosted by rank 0, keys prefixed by
the group name, so the trainer can keep its own training group and an engine needs none. This
is the same rendezvous SGLang's `/init_weights_update_group` performs, so a trainer can update
real SGLang servers and Tandem's engine alike.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout: timedelta,
) -> Any:
    from torch.distributed import TCPStore
    from torch.distributed import distributed_c10d as c10d

    deadline = time.monotonic() + timeout.total_seconds()
    if rank != 0:  # TCPStore retries a refused connect for about twice its timeout
        _wait_for_listener(master_address, master_port, deadline)
    # An explicit store, not `c10d.rendezvous`: under torchrun the latter connects to the
    # elastic agent's store instead of hosting one, and the engines would wait forever.
    left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    store = TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=left,
        wait_for_workers=False,
    )
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=timeout
    )
    # Group ranks equal the ranks passed to collectives on this group.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Return once something accepts connections at host:port; TimeoutError at `deadline`."""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, left))):
                return
        except socket.gaierror as exc:  # waiting will not make the name resolve
            raise ValueError(f"master_address {host!r} does not resolve: {exc}") from exc
        except OSError as exc:
            if time.monotonic() + 0.2 >= deadline:
                raise TimeoutError(
                    f"no weight-group rendezvous at {host}:{port} (the trainer hosts it) "
                    f"within the timeout: {exc}"
                ) from exc
            time.sleep(0.2)


def leave_group(group: Any) -> None:
    """Leave a weight group without waiting for its other ranks.

    On NCCL, `destroy_process_group` waits for every peer to tear the communicator down too
    (seen on H200s: a trainer closing its sender hung while its engines served on), and a
    peer that died never does. Aborting is local: the peers' next collective on the group
    fails, and the broker forms a fresh group for the next version anyway."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if dist.get_backend(group) == "nccl" and hasattr(c10d, "_abort_process_group"):
        c10d._abort_process_group(group)
    else:
        dist.destroy_process_group(group)
