"""gRPC channel options every fastexp client uses (the SDK, and the experience service's calls upstream)."""

from __future__ import annotations

#: Client channels try to reconnect to a peer that is gone at most this often. gRPC's own default grows to 120 s,
#: so a dependency that comes up after a long wait (an engine loading on a cold machine) or is restarted would
#: stay unused for up to two minutes after it turned SERVING: calls fail fast while the channel backs off.
RECONNECT_BACKOFF_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The largest message both ways (servers and clients)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """A client channel's options: :func:`message_options` and the reconnect backoff above."""
    return [*message_options(max_message_bytes), *RECONNECT_BACKOFF_OPTIONS]
