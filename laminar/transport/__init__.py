"""The wire: the only package that imports zmq, and it knows no role and no message catalogue.

    codec.py           any registered message <-> msgpack header + zero-copy array frames
    session.py         the wire's own messages: Hello/Welcome, Heartbeat (with an opaque
                       status), Bye, ErrorReply, Ack, Ping/Pong; StatusCodec
    sockets.py         errors, SocketOptions, Peer, attach (CURVE on tcp), send_within
    server.py          RpcServer (ROUTER)        client.py   RpcClient (DEALER)
    polled.py          PolledSocket: the server's socket read and written from the loop's
                       reader on its descriptor (no future per message; busy: gathered wake-ups)
    streams.py         Publisher/Subscriber (READY barrier), PushStream/PullStream
    security.py        CURVE keys and the ZAP authenticator

Imports: transport -> laminar/message.py (the message base), laminar/logs.py,
laminar/supervise.py; never laminar.config, laminar.protocol or a role package. Settings
come in as plain values: `SocketOptions`, `Security` and per-socket `max_message_bytes`,
built from the config by the wiring layer (laminar/wiring/common.py `socket_options`,
`socket_max_message_bytes`). Weight versions move through laminar/weights/.

Import each name from the module above that defines it (`laminar.transport.client.RpcClient`).
"""
