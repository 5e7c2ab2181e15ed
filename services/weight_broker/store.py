"""VersionStore: assembles buckets into complete versions and keeps the newest few.

Thread-safe: the intake thread adds buckets, the serve thread and the sync loop read versions.
Memory is bounded by `keep_versions` complete versions plus at most one version being
assembled per sender (a newer version evicts older incomplete ones).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from proto import WeightBucketHeader
from services.weight_sync.safetensors_file import tensors_nbytes
from services.weight_sync.wire import Frame, frame_view


@dataclass
class Version:
    version: int
    num_buckets: int
    buckets: dict[int, list[Frame]] = field(default_factory=dict)
    nbytes: int = 0

    def messages(self) -> list[list[Frame]]:
        return [self.buckets[i] for i in range(self.num_buckets)]


class VersionStore:
    def __init__(self, keep_versions: int = 2) -> None:
        self.keep_versions = max(1, keep_versions)
        self._partial: dict[int, Version] = {}
        self._complete: dict[int, Version] = {}
        self._lock = threading.Lock()
        self.latest = -1

    def add_bucket(self, header: WeightBucketHeader, message: list[Frame]) -> Version | None:
        """Store one bucket; return the version if this bucket completed it."""
        if header.num_buckets < 1 or not 0 <= header.bucket_index < header.num_buckets:
            raise ValueError(
                f"version {header.version}: bucket index {header.bucket_index} is outside "
                f"0..{header.num_buckets - 1}"
            )
        with self._lock:
            if header.version == self.latest:
                raise ValueError(f"weight version {header.version} arrived again: it is held")
            if header.version < self.latest:
                raise ValueError(
                    f"weight version {header.version} arrived after version {self.latest}: "
                    "versions must increase (was the trainer restarted without --load?)"
                )
            entry = self._partial.setdefault(
                header.version, Version(header.version, header.num_buckets)
            )
            if header.num_buckets != entry.num_buckets:
                raise ValueError(
                    f"version {header.version}: bucket {header.bucket_index} says "
                    f"{header.num_buckets} buckets, earlier ones said {entry.num_buckets}"
                )
            entry.buckets[header.bucket_index] = message
            entry.nbytes += (
                tensors_nbytes(header.tensors)
                if header.shm_path
                else sum(frame_view(f).nbytes for f in message[1:])
            )
            if len(entry.buckets) < entry.num_buckets:
                return None
            # This version and older incomplete ones (superseded) leave the partial set.
            self._partial = {v: e for v, e in self._partial.items() if v > header.version}
            self._complete[header.version] = entry
            for old in sorted(self._complete)[: -self.keep_versions]:
                del self._complete[old]
            self.latest = header.version
            return entry

    def discard(self, version: int) -> None:
        """Forget a complete version (refused): `latest` falls back to the newest one left."""
        with self._lock:
            self._complete.pop(version, None)
            if self.latest == version:
                self.latest = max(self._complete, default=-1)

    def get(self, version: int) -> Version | None:
        with self._lock:
            return self._complete.get(version)
