"""Message transports: RabbitMQ (``amqp``) and in-process (``inproc``), one interface."""

from shared.transport.base import (
    KEY_AGGREGATORS,
    KEY_CLIENTS,
    KEY_JOIN,
    KEY_SERVER,
    KEY_UPDATE,
    BrokerUnavailable,
    Delivery,
    Departed,
    ExperimentNames,
    Handler,
    Transport,
    Unroutable,
    key_aggregator,
    key_host,
    names,
    split,
)

__all__ = [
    "KEY_AGGREGATORS",
    "KEY_CLIENTS",
    "KEY_JOIN",
    "KEY_SERVER",
    "KEY_UPDATE",
    "BrokerUnavailable",
    "Delivery",
    "Departed",
    "ExperimentNames",
    "Handler",
    "Transport",
    "Unroutable",
    "key_aggregator",
    "key_host",
    "names",
    "split",
]
