"""A torch.distributed group for weight updates, separate from any default group.

Trainer rank 0 (rank 0 of this group) and every engine rank (`rank_offset + tp_rank`) call
`join_group` with the same address, port, world size and name; it returns once all have joined
(or raises after `timeout`). The rendezvous is a TCP store hosted by rank 0, keys prefixed by
the group name, so the trainer can keep its own training group and an engine needs none. This
is the same rendezvous SGLang's `/init_weights_update_group` performs, so a trainer can update
real SGLang servers and Tandem's engine alike.

A member that dies during a broadcast must not take the others with it. Under torch's default
`TORCH_NCCL_ASYNC_ERROR_HANDLING` (3), the NCCL watchdog ends the process when a collective
fails or runs past the group's timeout (seen on 4 H200s: an engine killed mid-run ended the
trainer). `join_group` makes NCCL groups under mode 2 (the watchdog aborts the communicator and
the process lives); `wait_all` waits with a timeout, so the failure reaches the caller as a
`RuntimeError`. Such a group is then dropped with `leave_group(group, failed=True)`, which
keeps it aside untouched: measured on 2 H200s, aborting or destroying a group the watchdog
aborted hangs that call or the next group's creation, and its destructor hangs at interpreter
exit, so it is only taken out of torch's registries and a process holding one ends without
destructors (`services.common.serving.end_without_destructors`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
# What NCCL weight groups are made under (each group reads them as it is made): a failed
# collective aborts the communicator and raises, the process lives; no debug dump on a timeout
# (a dead peer is no bug to trace; on 2 H200s the watchdog of a failed group reported its queued
# broadcasts one a minute, each with a dump).
SETTINGS = {ERROR_HANDLING: "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
_failed_groups: list[Any] = []  # NCCL groups put aside: one that failed, every one after it


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
    with _errors_raise(backend):
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


def destroy_all(timeout_s: float = 30.0) -> bool:
    """`destroy_process_group()` of every group left (the process's own: a trainer's training
    groups, which its other ranks destroy too); False if it did not end in `timeout_s`. Bounded
    only after a weight group failed: seen on 2 H200s, such a trainer's teardown did not end
    (this call, measured: it did not end in 30 s) while the failed group's watchdog still
    worked through the broadcasts queued on it, one a minute. The process then ends by
    `os._exit` whatever this left running."""
    import threading

    import torch.distributed as dist

    if not _failed_groups:
        dist.destroy_process_group()
        return True
    teardown = threading.Thread(target=dist.destroy_process_group, daemon=True)
    teardown.start()
    teardown.join(timeout_s)
    return not teardown.is_alive()


def _forget(group: Any) -> None:
    """Take a group out of torch's registries as `_abort_process_group` does after its abort,
    without the abort: a later group may take its name (seen on 2 H200s: an engine could not
    join SGLang's default group name again), and destroying every group (the trainer's
    `destroy_process_group()` at exit) passes it by instead of hanging on it."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config):
        table.pop(group, None)
    world.pg_coalesce_state.pop(group, None)
    tag = world.pg_to_tag.pop(group, None)
    for key in {tag, ""} if tag is not None else ():
        if group in world.tags_to_pg.get(key, []):
            world.tags_to_pg[key].remove(group)
    with contextlib.suppress(Exception):  # (not registered: nothing to take out)
        c10d._unregister_process_group(group.group_name)


@contextlib.contextmanager
def _errors_raise(backend: str) -> Iterator[None]:
    """NCCL process groups made inside take `SETTINGS` (the process's own are back after)."""
    if backend != "nccl":
        yield
        return
    before = {name: os.environ.get(name) for name in SETTINGS}
    os.environ.update(SETTINGS)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def wait_all(works: Iterable[Any], timeout: timedelta) -> None:
    """Wait for collectives, each within `timeout` (on NCCL this blocks the host). A failed one,
    or one past the timeout, raises a `RuntimeError` (`DistBackendError` on NCCL)."""
    for work in works:
        work.wait(timeout)


def leave_group(group: Any, failed: bool = False) -> None:
    """Leave a weight group without waiting for its other ranks; `failed`: a collective of it
    failed (`wait_all` raised).

    On NCCL, `destroy_process_group` waits for every peer to tear the communicator down too
    (seen on H200s: a trainer closing its sender hung while its engines served on), and a
    peer that died never does. Aborting is local: the peers' next collective on the group
    fails, and the broker forms a fresh group for the next version anyway. A failed NCCL group
    was aborted by the watchdog already and is only kept aside (see the module docstring); so
    is every NCCL group after one failed (see `destroy_all`)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if dist.get_backend(group) != "nccl":
        dist.destroy_process_group(group)
    elif failed or _failed_groups:
        if not _failed_groups:
            from services.common.serving import end_without_destructors

            end_without_destructors("an NCCL weight group failed (its destructor would hang)")
        _failed_groups.append(group)
        _forget(group)
    elif hasattr(c10d, "_abort_process_group"):
        c10d._abort_process_group(group)
    else:
        dist.destroy_process_group(group)
