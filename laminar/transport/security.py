"""CURVE encryption and authentication for tcp sockets.

    laminar keys /etc/laminar/keys        # node.key, node.key_secret, authorized/node.key
    security.keys_dir: /etc/laminar/keys  # in the run config, on every host

Every node of a cluster holds a key pair; servers accept only clients whose public
key is in `authorized/` (pyzmq's ZAP authenticator), clients pin the server key
(the same cluster key by default). A peer without a known key gets nothing through:
the handshake never completes, so its requests time out. `sockets.attach` applies a
node's `Security` to its tcp sockets only (ipc and inproc never leave the host).
"""

from __future__ import annotations

import os
import shutil
import weakref
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from laminar.config import LaminarConfig

# Keyed by the context object itself (weakly), never by id(): a dead context's id can be reused
# by a new one, which would then run without an authenticator and accept any client key.
_AUTHENTICATORS: weakref.WeakKeyDictionary[zmq.Context, AsyncioAuthenticator] = (
    weakref.WeakKeyDictionary()
)


def generate_keys(
    keys_dir: str | os.PathLike, name: str = "node", force: bool = False
) -> tuple[Path, Path]:
    """Write DIR/NAME.key + DIR/NAME.key_secret and authorize NAME in DIR/authorized/.
    An existing pair raises FileExistsError unless force: replacing it locks out every host
    that holds the old one."""
    root = Path(keys_dir)
    existing = [p for p in (root / f"{name}.key", root / f"{name}.key_secret") if p.exists()]
    if existing and not force:
        raise FileExistsError(
            f"{existing[0]} exists; every host holding it would be locked out by a new pair. "
            "Use --force to replace it, or --name for another pair"
        )
    root.mkdir(parents=True, exist_ok=True)
    (root / "authorized").mkdir(exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(root), name)
    os.chmod(secret, 0o600)
    shutil.copy(public, root / "authorized" / Path(public).name)
    return Path(public), Path(secret)


class Security:
    """CURVE settings shared by a node's tcp sockets."""

    def __init__(
        self, keys_dir: str | os.PathLike, name: str = "node", server_key: str | None = None
    ):
        self.root = Path(keys_dir)
        secret_file = self.root / f"{name}.key_secret"
        if not secret_file.exists():
            raise FileNotFoundError(
                f"no secret key {secret_file}; create one with `laminar keys {self.root}`"
            )
        self.public, self.secret = zmq.auth.load_certificate(str(secret_file))
        server_file = Path(server_key) if server_key else self.root / "node.key"
        self.server_public, _ = zmq.auth.load_certificate(str(server_file))
        self.authorized = self.root / "authorized"

    def ensure_authenticator(self, ctx: zmq.Context) -> None:
        """One ZAP authenticator per context, allowing only keys in authorized/."""
        auth = _AUTHENTICATORS.get(ctx)
        if auth is not None and auth.zap_socket is not None:  # stop() clears it
            return
        auth = AsyncioAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=str(self.authorized))
        _AUTHENTICATORS[ctx] = auth

    def apply_server(self, sock: zmq.Socket) -> None:
        self.ensure_authenticator(sock.context)
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def apply_client(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


def stop_authenticators() -> None:
    for auth in list(_AUTHENTICATORS.values()):
        auth.stop()
    _AUTHENTICATORS.clear()


def security_from_config(cfg: LaminarConfig) -> Security | None:
    """The node's CURVE settings, or None when `security.keys_dir` is unset (no CURVE)."""
    if not cfg.security.keys_dir:
        return None
    return Security(cfg.security.keys_dir)
