import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from . import broker_pb2 as _broker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListSubscriptionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscriptionInfo(_message.Message):
    __slots__ = ("subscription_id", "mode", "consumer_group", "topic_patterns", "queue_depth", "capacity", "delivered", "opened_at", "peer_address", "ack_mode", "replica_id", "unacked", "oldest_unacked_age")
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_GROUP_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PATTERNS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    OPENED_AT_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ACK_MODE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    UNACKED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_UNACKED_AGE_FIELD_NUMBER: _ClassVar[int]
    subscription_id: str
    mode: _broker_pb2.DeliveryMode
    consumer_group: str
    topic_patterns: _containers.RepeatedScalarFieldContainer[str]
    queue_depth: int
    capacity: int
    delivered: int
    opened_at: _timestamp_pb2.Timestamp
    peer_address: str
    ack_mode: _broker_pb2.AckMode
    replica_id: str
    unacked: int
    oldest_unacked_age: _duration_pb2.Duration
    def __init__(self, subscription_id: _Optional[str] = ..., mode: _Optional[_Union[_broker_pb2.DeliveryMode, str]] = ..., consumer_group: _Optional[str] = ..., topic_patterns: _Optional[_Iterable[str]] = ..., queue_depth: _Optional[int] = ..., capacity: _Optional[int] = ..., delivered: _Optional[int] = ..., opened_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., peer_address: _Optional[str] = ..., ack_mode: _Optional[_Union[_broker_pb2.AckMode, str]] = ..., replica_id: _Optional[str] = ..., unacked: _Optional[int] = ..., oldest_unacked_age: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ListSubscriptionsResponse(_message.Message):
    __slots__ = ("subscriptions",)
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    subscriptions: _containers.RepeatedCompositeFieldContainer[SubscriptionInfo]
    def __init__(self, subscriptions: _Optional[_Iterable[_Union[SubscriptionInfo, _Mapping]]] = ...) -> None: ...

class ListConsumerGroupsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConsumerGroupInfo(_message.Message):
    __slots__ = ("name", "topic_patterns", "members", "backlog", "in_flight", "redeliveries", "dead_lettered", "dropped", "oldest_unacked_age")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PATTERNS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REDELIVERIES_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_UNACKED_AGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    topic_patterns: _containers.RepeatedScalarFieldContainer[str]
    members: int
    backlog: int
    in_flight: int
    redeliveries: int
    dead_lettered: int
    dropped: int
    oldest_unacked_age: _duration_pb2.Duration
    def __init__(self, name: _Optional[str] = ..., topic_patterns: _Optional[_Iterable[str]] = ..., members: _Optional[int] = ..., backlog: _Optional[int] = ..., in_flight: _Optional[int] = ..., redeliveries: _Optional[int] = ..., dead_lettered: _Optional[int] = ..., dropped: _Optional[int] = ..., oldest_unacked_age: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ListConsumerGroupsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[ConsumerGroupInfo]
    def __init__(self, groups: _Optional[_Iterable[_Union[ConsumerGroupInfo, _Mapping]]] = ...) -> None: ...

class CloseSubscriptionRequest(_message.Message):
    __slots__ = ("subscription_id",)
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    subscription_id: str
    def __init__(self, subscription_id: _Optional[str] = ...) -> None: ...

class CloseSubscriptionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEvictionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvictionInfo(_message.Message):
    __slots__ = ("subscription_id", "evicted_at", "topic_patterns", "queue_depth", "last_delivered_sequence", "peer_address", "replica_id")
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    EVICTED_AT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_PATTERNS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LAST_DELIVERED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    subscription_id: str
    evicted_at: _timestamp_pb2.Timestamp
    topic_patterns: _containers.RepeatedScalarFieldContainer[str]
    queue_depth: int
    last_delivered_sequence: int
    peer_address: str
    replica_id: str
    def __init__(self, subscription_id: _Optional[str] = ..., evicted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., topic_patterns: _Optional[_Iterable[str]] = ..., queue_depth: _Optional[int] = ..., last_delivered_sequence: _Optional[int] = ..., peer_address: _Optional[str] = ..., replica_id: _Optional[str] = ...) -> None: ...

class ListEvictionsResponse(_message.Message):
    __slots__ = ("evictions",)
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    evictions: _containers.RepeatedCompositeFieldContainer[EvictionInfo]
    def __init__(self, evictions: _Optional[_Iterable[_Union[EvictionInfo, _Mapping]]] = ...) -> None: ...

class GetBrokerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BrokerLimits(_message.Message):
    __slots__ = ("consumer_capacity", "group_capacity", "default_max_in_flight", "default_ack_deadline_ms", "max_delivery_attempts", "group_idle_ttl_seconds", "max_message_bytes", "max_subscriptions", "shutdown_grace_seconds", "max_patterns_per_subscription", "max_topic_bytes", "max_headers", "consumer_max_bytes", "group_max_bytes", "max_memory_bytes", "max_connections", "handshake_timeout_seconds", "max_subscriptions_per_session", "max_batch_messages")
    CONSUMER_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    GROUP_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ACK_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_DELIVERY_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDLE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_PATTERNS_PER_SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOPIC_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_HEADERS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUP_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SUBSCRIPTIONS_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    consumer_capacity: int
    group_capacity: int
    default_max_in_flight: int
    default_ack_deadline_ms: int
    max_delivery_attempts: int
    group_idle_ttl_seconds: int
    max_message_bytes: int
    max_subscriptions: int
    shutdown_grace_seconds: int
    max_patterns_per_subscription: int
    max_topic_bytes: int
    max_headers: int
    consumer_max_bytes: int
    group_max_bytes: int
    max_memory_bytes: int
    max_connections: int
    handshake_timeout_seconds: int
    max_subscriptions_per_session: int
    max_batch_messages: int
    def __init__(self, consumer_capacity: _Optional[int] = ..., group_capacity: _Optional[int] = ..., default_max_in_flight: _Optional[int] = ..., default_ack_deadline_ms: _Optional[int] = ..., max_delivery_attempts: _Optional[int] = ..., group_idle_ttl_seconds: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_subscriptions: _Optional[int] = ..., shutdown_grace_seconds: _Optional[int] = ..., max_patterns_per_subscription: _Optional[int] = ..., max_topic_bytes: _Optional[int] = ..., max_headers: _Optional[int] = ..., consumer_max_bytes: _Optional[int] = ..., group_max_bytes: _Optional[int] = ..., max_memory_bytes: _Optional[int] = ..., max_connections: _Optional[int] = ..., handshake_timeout_seconds: _Optional[int] = ..., max_subscriptions_per_session: _Optional[int] = ..., max_batch_messages: _Optional[int] = ...) -> None: ...

class GetBrokerInfoResponse(_message.Message):
    __slots__ = ("version", "uptime", "started_at", "limits", "subscriptions", "consumer_groups", "last_sequence", "auth_enabled", "tls_enabled", "cluster_mode", "replica_id", "nats_server", "messages_published", "messages_delivered")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    AUTH_ENABLED_FIELD_NUMBER: _ClassVar[int]
    TLS_ENABLED_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_MODE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    NATS_SERVER_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime: _duration_pb2.Duration
    started_at: _timestamp_pb2.Timestamp
    limits: BrokerLimits
    subscriptions: int
    consumer_groups: int
    last_sequence: int
    auth_enabled: bool
    tls_enabled: bool
    cluster_mode: bool
    replica_id: str
    nats_server: str
    messages_published: int
    messages_delivered: int
    def __init__(self, version: _Optional[str] = ..., uptime: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., limits: _Optional[_Union[BrokerLimits, _Mapping]] = ..., subscriptions: _Optional[int] = ..., consumer_groups: _Optional[int] = ..., last_sequence: _Optional[int] = ..., auth_enabled: bool = ..., tls_enabled: bool = ..., cluster_mode: bool = ..., replica_id: _Optional[str] = ..., nats_server: _Optional[str] = ..., messages_published: _Optional[int] = ..., messages_delivered: _Optional[int] = ...) -> None: ...
