"""Transport: the only package that imports zmq (codec, sockets, security, weight transports)."""

from laminar.transport.codec import (
    PROTOCOL_VERSION,
    Arr,
    Message,
    ProtocolError,
    decode,
    encode,
    message,
)

__all__ = ["PROTOCOL_VERSION", "Arr", "Message", "ProtocolError", "decode", "encode", "message"]
