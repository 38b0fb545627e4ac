import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeliveryMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELIVERY_MODE_UNSPECIFIED: _ClassVar[DeliveryMode]
    DELIVERY_MODE_MULTI: _ClassVar[DeliveryMode]
    DELIVERY_MODE_SINGLE: _ClassVar[DeliveryMode]

class AckMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_MODE_UNSPECIFIED: _ClassVar[AckMode]
    ACK_MODE_AUTO: _ClassVar[AckMode]
    ACK_MODE_MANUAL: _ClassVar[AckMode]
DELIVERY_MODE_UNSPECIFIED: DeliveryMode
DELIVERY_MODE_MULTI: DeliveryMode
DELIVERY_MODE_SINGLE: DeliveryMode
ACK_MODE_UNSPECIFIED: AckMode
ACK_MODE_AUTO: AckMode
ACK_MODE_MANUAL: AckMode

class PublishRequest(_message.Message):
    __slots__ = ("topic", "payload", "headers")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    payload: bytes
    headers: _containers.ScalarMap[str, str]
    def __init__(self, topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("sequence", "matched_subscriptions", "matched_groups")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    matched_subscriptions: int
    matched_groups: int
    def __init__(self, sequence: _Optional[int] = ..., matched_subscriptions: _Optional[int] = ..., matched_groups: _Optional[int] = ...) -> None: ...

class PublishStreamResponse(_message.Message):
    __slots__ = ("accepted", "first_sequence", "last_sequence")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    first_sequence: int
    last_sequence: int
    def __init__(self, accepted: _Optional[int] = ..., first_sequence: _Optional[int] = ..., last_sequence: _Optional[int] = ...) -> None: ...

class OpenSubscriptionRequest(_message.Message):
    __slots__ = ("topic_patterns", "mode", "subscription_id", "consumer_group", "ack_mode", "max_in_flight", "ack_deadline_ms")
    TOPIC_PATTERNS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_GROUP_FIELD_NUMBER: _ClassVar[int]
    ACK_MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ACK_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    topic_patterns: _containers.RepeatedScalarFieldContainer[str]
    mode: DeliveryMode
    subscription_id: str
    consumer_group: str
    ack_mode: AckMode
    max_in_flight: int
    ack_deadline_ms: int
    def __init__(self, topic_patterns: _Optional[_Iterable[str]] = ..., mode: _Optional[_Union[DeliveryMode, str]] = ..., subscription_id: _Optional[str] = ..., consumer_group: _Optional[str] = ..., ack_mode: _Optional[_Union[AckMode, str]] = ..., max_in_flight: _Optional[int] = ..., ack_deadline_ms: _Optional[int] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("topic", "payload", "headers", "sequence", "publish_time", "subscription_id", "consumer_group", "delivery_attempt")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_TIME_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_GROUP_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    topic: str
    payload: bytes
    headers: _containers.ScalarMap[str, str]
    sequence: int
    publish_time: _timestamp_pb2.Timestamp
    subscription_id: str
    consumer_group: str
    delivery_attempt: int
    def __init__(self, topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., headers: _Optional[_Mapping[str, str]] = ..., sequence: _Optional[int] = ..., publish_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., subscription_id: _Optional[str] = ..., consumer_group: _Optional[str] = ..., delivery_attempt: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("subscription_id", "sequences")
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    subscription_id: str
    sequences: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, subscription_id: _Optional[str] = ..., sequences: _Optional[_Iterable[int]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("acked", "unknown")
    ACKED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    acked: int
    unknown: int
    def __init__(self, acked: _Optional[int] = ..., unknown: _Optional[int] = ...) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("subscription_id", "sequences")
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    subscription_id: str
    sequences: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, subscription_id: _Optional[str] = ..., sequences: _Optional[_Iterable[int]] = ...) -> None: ...

class NackResponse(_message.Message):
    __slots__ = ("requeued", "unknown")
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    requeued: int
    unknown: int
    def __init__(self, requeued: _Optional[int] = ..., unknown: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "close", "credit", "ack", "nack", "publish")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    NACK_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    close: SessionClose
    credit: SessionCredit
    ack: SessionAck
    nack: SessionNack
    publish: SessionPublish
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., close: _Optional[_Union[SessionClose, _Mapping]] = ..., credit: _Optional[_Union[SessionCredit, _Mapping]] = ..., ack: _Optional[_Union[SessionAck, _Mapping]] = ..., nack: _Optional[_Union[SessionNack, _Mapping]] = ..., publish: _Optional[_Union[SessionPublish, _Mapping]] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("handle", "subscription", "credit")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    handle: int
    subscription: OpenSubscriptionRequest
    credit: int
    def __init__(self, handle: _Optional[int] = ..., subscription: _Optional[_Union[OpenSubscriptionRequest, _Mapping]] = ..., credit: _Optional[int] = ...) -> None: ...

class SessionClose(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    def __init__(self, handle: _Optional[int] = ...) -> None: ...

class SessionCredit(_message.Message):
    __slots__ = ("handle", "messages")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    messages: int
    def __init__(self, handle: _Optional[int] = ..., messages: _Optional[int] = ...) -> None: ...

class SessionAck(_message.Message):
    __slots__ = ("handle", "sequences")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    sequences: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[int] = ..., sequences: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionNack(_message.Message):
    __slots__ = ("handle", "sequences")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    sequences: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[int] = ..., sequences: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionPublish(_message.Message):
    __slots__ = ("id", "messages")
    ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    id: int
    messages: _containers.RepeatedCompositeFieldContainer[PublishRequest]
    def __init__(self, id: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[PublishRequest, _Mapping]]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("opened", "delivery", "ended", "published", "deliveries")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    delivery: SessionDelivery
    ended: SessionEnded
    published: SessionPublished
    deliveries: SessionDeliveries
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., delivery: _Optional[_Union[SessionDelivery, _Mapping]] = ..., ended: _Optional[_Union[SessionEnded, _Mapping]] = ..., published: _Optional[_Union[SessionPublished, _Mapping]] = ..., deliveries: _Optional[_Union[SessionDeliveries, _Mapping]] = ...) -> None: ...

class SessionPublished(_message.Message):
    __slots__ = ("id", "first_sequence", "accepted", "rejected")
    ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    id: int
    first_sequence: int
    accepted: int
    rejected: _containers.RepeatedCompositeFieldContainer[PublishRejection]
    def __init__(self, id: _Optional[int] = ..., first_sequence: _Optional[int] = ..., accepted: _Optional[int] = ..., rejected: _Optional[_Iterable[_Union[PublishRejection, _Mapping]]] = ...) -> None: ...

class PublishRejection(_message.Message):
    __slots__ = ("index", "code", "message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    code: int
    message: str
    def __init__(self, index: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionDeliveries(_message.Message):
    __slots__ = ("deliveries",)
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    deliveries: _containers.RepeatedCompositeFieldContainer[SessionDelivery]
    def __init__(self, deliveries: _Optional[_Iterable[_Union[SessionDelivery, _Mapping]]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("handle", "subscription_id")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    handle: int
    subscription_id: str
    def __init__(self, handle: _Optional[int] = ..., subscription_id: _Optional[str] = ...) -> None: ...

class SessionDelivery(_message.Message):
    __slots__ = ("handles", "message")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[int]
    message: Message
    def __init__(self, handles: _Optional[_Iterable[int]] = ..., message: _Optional[_Union[Message, _Mapping]] = ...) -> None: ...

class SessionEnded(_message.Message):
    __slots__ = ("handle", "reason", "dropped", "last_sequence", "code", "message")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    reason: str
    dropped: int
    last_sequence: int
    code: int
    message: str
    def __init__(self, handle: _Optional[int] = ..., reason: _Optional[str] = ..., dropped: _Optional[int] = ..., last_sequence: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
