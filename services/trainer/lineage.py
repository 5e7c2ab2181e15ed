"""What a trainer start does to the run's lineage of weights in Redis: `begin_lineage` for
--new-lineage (its versions begin after the published one; groups stamped with an older version
are dead-lettered as foreign) and `rewind_ledger` for a resume from a checkpoint. Whether a
start may continue at all (a start without checkpoint on a trained run is refused unless
--new-lineage) is `config.lineage_start`, a start-up check `tandem up` runs before the engines.
Knows nothing of torch."""

from __future__ import annotations

from typing import Any

from services.sample_buffer import SampleBuffer, recovery


def begin_lineage(buffer: SampleBuffer, version: int, weights: str = "--model") -> None:
    """--new-lineage: the lineage of the newest weights (`trained`) starts anew at `version`,
    from `weights`."""
    trained = buffer.counters().get("groups_trained", 0)
    pipe = buffer.redis.pipeline(transaction=True)
    pipe.delete(buffer.trained_key)
    pipe.hset(buffer.counters_key, recovery.EARLIER, trained)  # (a later rewind keeps them)
    pipe.execute()
    print(
        f"[trainer] --new-lineage: starting from {weights} as version {version}; groups made "
        f"by older versions are dead-lettered (foreign_lineage)",
        flush=True,
    )


def rewind_ledger(buffer: SampleBuffer, resumed: Any, version: int) -> str:
    """On a resume at `version` from a checkpoint (`resumed`, checkpoint.py) that had consumed
    `resumed.groups_consumed` groups: the groups consumed after its save are pending again, but
    for the dead letters written since. A buffer with no record of the groups `version` trained lost the run's
    data (a new Redis): nothing is rewound, its ledger counts from there; the sentence that
    says so ("" when rewound)."""
    consumed = resumed.groups_consumed
    if version and not buffer.redis.hexists(buffer.trained_key, str(version)):
        return (
            f"the buffer holds no record of the groups version {version} trained (nor of the "
            f"{consumed} this checkpoint consumed): its Redis lost the run's data; its ledger "
            "counts from here, and training goes on from the checkpoint"
        )
    now = buffer.counters().get("groups_dead_lettered", 0)
    saved = resumed.groups_dead_lettered
    since = max(now - (now if saved is None else saved), 0)
    buffer.rewind_trainer(consumed + since, version)
    return ""
