"""Trajectory transport on Redis Streams, the weight-version channel and global admission.

See docs/transport.md. Submodules: wire (format), content (is a group trainable?), names (keys),
connection, streams, versions, admission.
"""

from asyncrl.api.stream_names import StreamNames

from .admission import Admission, AdmissionSnapshot, admission_capacity
from .connection import RedisUnavailableError, connect
from .content import GroupLimits, check_group
from .streams import Delivery, TrajectoryConsumer, TrajectoryProducer
from .versions import EngineInfo, EngineRegistry, VersionChannel, VersionEvent
from .wire import SCHEMA_VERSION, TrajectoryGroup, TrajectorySample, WireFormatError, decode_group, encode_group

__all__ = [
    "SCHEMA_VERSION",
    "Admission",
    "AdmissionSnapshot",
    "Delivery",
    "EngineInfo",
    "EngineRegistry",
    "GroupLimits",
    "RedisUnavailableError",
    "StreamNames",
    "TrajectoryConsumer",
    "TrajectoryGroup",
    "TrajectoryProducer",
    "TrajectorySample",
    "VersionChannel",
    "VersionEvent",
    "WireFormatError",
    "admission_capacity",
    "check_group",
    "connect",
    "decode_group",
    "encode_group",
]
