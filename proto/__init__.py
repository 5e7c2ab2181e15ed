"""Wire schemas shared by every Tandem service.

Each message is a msgspec struct encoded with msgpack. A message's docstring says who sends it
and who receives it. Nothing here imports torch: tensors travel as raw bytes beside a header.
"""

from proto.drops import DeadLetterReason, DropReason
from proto.messages import (
    SCHEMA_VERSION,
    DropRecord,
    MetricsRecord,
    NcclAck,
    NcclCommand,
    NcclOffer,
    Sample,
    SampleGroup,
    TensorMeta,
    WeightBucketHeader,
    WeightRequest,
    decode,
    encode,
)

__all__ = [
    "SCHEMA_VERSION",
    "DeadLetterReason",
    "DropReason",
    "DropRecord",
    "MetricsRecord",
    "NcclAck",
    "NcclCommand",
    "NcclOffer",
    "Sample",
    "SampleGroup",
    "TensorMeta",
    "WeightBucketHeader",
    "WeightRequest",
    "decode",
    "encode",
]
