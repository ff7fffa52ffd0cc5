"""CURVE encryption, authentication and identity per role for tcp sockets.

    laminar keys /etc/laminar/keys                            # node.key pair: the servers' key
    laminar keys /etc/laminar/keys --roles manager,buffer,relay,trainer,rollout,tools
    laminar keys /etc/laminar/keys --name host-3 --roles rollout,tools      # one pair per host
    security.keys_dir: /etc/laminar/keys                      # in the run config, on every host

Servers (manager, buffer, relay, tools) share the `node` pair as their server key; clients pin its
public half. As a client, a node uses its role's pair (`<role>.key_secret`), or the pair named by
`security.key_name` (per host), or `node` when neither exists. ZAP (pyzmq's authenticator) admits
only public keys in `authorized/`, so a peer without a known key gets nothing through: the
handshake never completes and its requests time out.

Identity per role: `roles.json` maps each public key (z85) to the roles, and node ids, it may
claim (the server pair: any, "*"; it lives only on the server hosts). An RpcServer reads the peer's
key from the ZAP "User-Id" of its HELLO and refuses a claimed role or node id that the key does not
allow (`Security.check_claim`). With no `roles.json` (one shared key) any key holder may claim any
role. Without CURVE (no keys_dir, or ipc/inproc), a HELLO's role and node id are unauthenticated:
whoever reaches the socket can claim any identity, so tcp without CURVE is warned about loudly at
startup.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import weakref
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

ROLES_FILE = "roles.json"
"""DIR/roles.json: {public_key_z85: {"name": NAME, "roles": [...], "node_ids": [glob, ...]}}."""

SERVER_KEY = "node"

# Keyed by the context object itself (weakly), never by id(): a dead context's id can be reused
# by a new one, which would then run without an authenticator and accept any client key.
_AUTHENTICATORS: weakref.WeakKeyDictionary[zmq.Context, AsyncioAuthenticator] = (
    weakref.WeakKeyDictionary()
)


def generate_keys(
    keys_dir: str | os.PathLike,
    name: str = SERVER_KEY,
    force: bool = False,
    roles: list[str] | None = None,
) -> tuple[Path, Path]:
    """Write DIR/NAME.key + DIR/NAME.key_secret and authorize NAME in DIR/authorized/; with
    `roles`, record in DIR/roles.json that this key may claim those roles (ids `<role>-*`).
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
    old_public = _public_z85(root / f"{name}.key") if existing else None
    public, secret = zmq.auth.create_certificates(str(root), name)
    os.chmod(secret, 0o600)
    shutil.copy(public, root / "authorized" / Path(public).name)
    if roles:
        table = load_roles(root) or {}
        if old_public is not None:
            table.pop(old_public, None)
        table[_public_z85(Path(public))] = {
            "name": name,
            "roles": sorted(set(roles)),
            "node_ids": sorted({p for r in roles for p in (r, f"{r}-*")}),
        }
        (root / ROLES_FILE).write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    return Path(public), Path(secret)


def generate_role_keys(
    keys_dir: str | os.PathLike, roles: list[str], force: bool = False
) -> list[Path]:
    """`laminar keys DIR --roles a,b`: the server pair (if missing) and one pair per role, each
    allowed to claim only its own role. Returns the public key files written."""
    root = Path(keys_dir)
    written = []
    if not (root / f"{SERVER_KEY}.key_secret").exists():
        written.append(generate_keys(root, SERVER_KEY)[0])
    # the server pair lives on the server hosts, which run `laminar status` and relay tooling
    table = load_roles(root) or {}
    table[_public_z85(root / f"{SERVER_KEY}.key")] = {
        "name": SERVER_KEY,
        "roles": ["*"],
        "node_ids": ["*"],
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / ROLES_FILE).write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    for role in roles:
        written.append(generate_keys(root, role, force=force, roles=[role])[0])
    return written


def load_roles(keys_dir: str | os.PathLike) -> dict[str, dict] | None:
    """DIR/roles.json, or None when there is none (one shared key: no identity per role)."""
    path = Path(keys_dir) / ROLES_FILE
    if not path.exists():
        return None
    table = json.loads(path.read_text())
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected an object mapping public keys to roles")
    return table


def _public_z85(public_file: Path) -> str:
    public, _ = zmq.auth.load_certificate(str(public_file))
    return public.decode()


class IdentityRefused(ValueError):
    """A HELLO claimed a role or node id that its CURVE key may not claim."""


class Security:
    """CURVE settings shared by a node's tcp sockets, and the key -> roles table its servers
    check."""

    def __init__(
        self,
        keys_dir: str | os.PathLike,
        name: str = SERVER_KEY,
        server_key: str | None = None,
    ):
        self.root = Path(keys_dir)
        secret_file = self.root / f"{name}.key_secret"
        if not secret_file.exists():
            raise FileNotFoundError(
                f"no secret key {secret_file}; create one with `laminar keys {self.root}`"
            )
        self.name = name
        self.public, self.secret = zmq.auth.load_certificate(str(secret_file))
        server_file = Path(server_key) if server_key else self.root / f"{SERVER_KEY}.key"
        self.server_public, _ = zmq.auth.load_certificate(str(server_file))
        self.authorized = self.root / "authorized"
        self.roles = load_roles(self.root)

    @classmethod
    def for_role(
        cls, keys_dir: str | os.PathLike, role: str, key_name: str | None = None
    ) -> Security:
        """The pair named `key_name` (per host), else the role's own pair, else the shared one."""
        root = Path(keys_dir)
        if key_name is None:
            key_name = role if (root / f"{role}.key_secret").exists() else SERVER_KEY
        return cls(root, key_name)

    def check_claim(self, user_id: str | None, role: str, node_id: str) -> None:
        """Raise IdentityRefused unless the key `user_id` (z85, from ZAP) may claim role/node_id.
        No user id (ipc/inproc: no CURVE) or no roles.json: nothing to check against."""
        if user_id is None or self.roles is None:
            return
        entry = self.roles.get(user_id)
        if entry is None:
            raise IdentityRefused(f"key {user_id[:8]}... is in no role of {ROLES_FILE}")
        allowed = entry.get("roles", [])
        if role not in allowed and "*" not in allowed:
            raise IdentityRefused(
                f"key {entry.get('name', user_id[:8])!r} may claim {entry.get('roles')}, not "
                f"{role!r}"
            )
        patterns = entry.get("node_ids") or [role, f"{role}-*"]
        if not any(fnmatch.fnmatchcase(node_id, p) for p in patterns):
            raise IdentityRefused(
                f"key {entry.get('name', user_id[:8])!r} may not claim node id {node_id!r}"
            )

    def key_name(self, user_id: str) -> str:
        """The name roles.json gives the key `user_id` (z85), else its first characters."""
        entry = (self.roles or {}).get(user_id) or {}
        return str(entry.get("name") or f"{user_id[:8]}...")

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
        """Servers bind with the shared server pair: clients pin its public half."""
        if self.name == SERVER_KEY:
            public, secret = self.public, self.secret
        else:
            secret_file = self.root / f"{SERVER_KEY}.key_secret"
            if not secret_file.exists():
                raise FileNotFoundError(
                    f"a tcp server needs the server key {secret_file} on this host "
                    f"(`laminar keys {self.root}` made it)"
                )
            public, secret = zmq.auth.load_certificate(str(secret_file))
        self.ensure_authenticator(sock.context)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def apply_client(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


def peer_key(frame: zmq.Frame) -> str | None:
    """The CURVE public key (z85) that ZAP authenticated for this message, or None (no CURVE)."""
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user_id if isinstance(user_id, str) and user_id else None


def stop_authenticators() -> None:
    for auth in list(_AUTHENTICATORS.values()):
        auth.stop()
    _AUTHENTICATORS.clear()
