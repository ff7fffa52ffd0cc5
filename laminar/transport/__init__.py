"""The wire: the only package that imports zmq, and it imports nothing from the roles.

    codec.py           typed messages <-> msgpack header + zero-copy array frames
    sockets.py         errors, SocketOptions, Peer, attach (CURVE on tcp), send_within
    server.py          RpcServer (ROUTER)        client.py   RpcClient (DEALER)
    streams.py         Publisher/Subscriber (READY barrier), PushStream/PullStream
    security.py        CURVE keys and the ZAP authenticator
    weight_layout.py, weights*.py   the weights channel (chunk layout, checksums, ends)

Names are imported from the module that defines them; this package re-exports nothing.
"""
