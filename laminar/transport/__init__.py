"""The wire: the only package that imports zmq, and it imports nothing from the roles.

    codec.py           typed messages <-> msgpack header + zero-copy array frames
    sockets.py         errors, SocketOptions, Peer, attach (CURVE on tcp), send_within
    server.py          RpcServer (ROUTER)        client.py   RpcClient (DEALER)
    streams.py         Publisher/Subscriber (READY barrier), PushStream/PullStream
    security.py        CURVE keys and the ZAP authenticator
    weight_layout.py, weights*.py   the weights channel (chunk layout, checksums, ends)

Import each name from the module above that defines it (`laminar.transport.client.RpcClient`).
"""
