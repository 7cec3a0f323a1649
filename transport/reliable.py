"""The reliable control plane: pyzmq over TCP, authenticated with the cluster key (ZeroMQ CURVE).

Cluster key: one CURVE key pair, generated once (`halo-master keygen`) and copied to every device
(/etc/halo/cluster.key, mode 0600). Agents listen as CURVE servers with it and admit, through a ZAP
handler, only clients that hold the same key pair: a master without the secret cannot finish the
handshake, and every frame is encrypted. The same secret is the base of every session's datagram key
(`udp_key`, wire.session_key). Plaintext is possible only when the caller passes `insecure=True` (a trusted test bed).

Device keys (`halo-master keygen --device NAME`): a pair per device, and allow-lists (AuthorizedKeys): an agent admits
only the masters in its --authorized-masters file; a master connects only to the agents in its --authorized-agents
file, each at its address with its key (CURVE refuses another). Whoever takes one device holds only its key: it cannot
act as master to the others, and deleting its line revokes it. Sessions' datagram keys then come from the nonce alone,
which travels encrypted.

Messages are multipart: frame 0 = b"HALO" + version byte; frame 1 = a JSON header
{"kind": ..., "fields": {...}, "arrays": [[dtype, shape], ...]}; then one raw frame per array.
`decode` validates all of it and raises `MessageError` naming what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from halo.errors import ConfigError

PROTOCOL = b"HALO"
PROTOCOL_VERSION = 2  # 2: the control messages of transport/control.py; no capability flags
MAX_HEADER_BYTES = 1 << 20
MAX_ARRAY_BYTES = 1 << 30
MAX_ARRAY_DIMS = 8
MAX_HEADER_DEPTH = 32  # protocol headers nest a few levels; json's own limit is the interpreter's stack
ARRAY_DTYPES = {"float32", "float16", "int64", "int32", "uint8", "int8"}


class MessageError(Exception):
    """A frame sequence that is not a valid halo message (the peer is buggy, stale or hostile)."""


@dataclass
class Message:
    kind: str
    fields: dict = field(default_factory=dict)
    arrays: list = field(default_factory=list)


def encode(message: Message) -> list[bytes]:
    arrays = [np.ascontiguousarray(a) for a in message.arrays]
    header = {"kind": message.kind, "fields": message.fields,
              "arrays": [[str(a.dtype), list(a.shape)] for a in arrays]}
    return [PROTOCOL + bytes([PROTOCOL_VERSION]), json.dumps(header).encode(), *(a.tobytes() for a in arrays)]


def decode(frames: list[bytes]) -> Message:
    if len(frames) < 2:
        raise MessageError(f"expected at least 2 frames, got {len(frames)}")
    preamble = bytes(frames[0])
    if len(preamble) != 5 or preamble[:4] != PROTOCOL:
        raise MessageError("not a halo message (bad preamble)")
    if preamble[4] != PROTOCOL_VERSION:
        raise MessageError(f"protocol version {preamble[4]} but this halo speaks {PROTOCOL_VERSION}: "
                           "run the same halo version on the master and every agent")
    raw = bytes(frames[1])
    if len(raw) > MAX_HEADER_BYTES:
        raise MessageError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(raw)
        kind, fields, specs = header["kind"], header["fields"], header["arrays"]
    except RecursionError:
        raise MessageError(f"malformed header: nested deeper than {MAX_HEADER_DEPTH} levels") from None
    except (ValueError, KeyError, TypeError) as e:
        raise MessageError(f"malformed header: {e!r:.200}") from None
    if not isinstance(kind, str) or not isinstance(fields, dict) or not isinstance(specs, list):
        raise MessageError("malformed header: kind/fields/arrays have the wrong types")
    # a nesting bound keeps later recursive walks (logging, re-encoding) of `fields` safe; an object
    # cannot nest deeper than its count of opening brackets, so ordinary headers skip the walk
    if raw.count(b"[") + raw.count(b"{") > MAX_HEADER_DEPTH and _depth(header) > MAX_HEADER_DEPTH:
        raise MessageError(f"malformed header: nested deeper than {MAX_HEADER_DEPTH} levels")
    if len(specs) != len(frames) - 2:
        raise MessageError(f"header announces {len(specs)} arrays but {len(frames) - 2} frames follow")
    arrays = []
    for spec, frame in zip(specs, frames[2:]):
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str) and spec[0] in ARRAY_DTYPES
                and isinstance(spec[1], list)
                and len(spec[1]) <= MAX_ARRAY_DIMS
                and all(type(s) is int and 0 <= s <= MAX_ARRAY_BYTES for s in spec[1])):
            raise MessageError(f"array spec {spec!r:.200} is not allowed: expected [dtype, shape], dtype one of "
                               f"{sorted(ARRAY_DTYPES)}, at most {MAX_ARRAY_DIMS} non-negative integer sizes")
        dtype, shape = np.dtype(spec[0]), tuple(spec[1])
        expected = math.prod(shape) * dtype.itemsize
        if expected > MAX_ARRAY_BYTES or expected != len(frame):
            raise MessageError(f"array {dtype}{list(shape)} needs {expected} bytes, frame has {len(frame)}")
        arrays.append(np.frombuffer(frame, dtype=dtype).reshape(shape))
    return Message(kind, fields, arrays)


def _depth(value) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


# ---- keys --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AuthorizedKey:
    public: bytes  # z85, 40 bytes
    name: str
    endpoint: str | None = None  # where the device listens ("tcp://HOST:PORT"; agents in a master's list)


@dataclass(frozen=True)
class AuthorizedKeys:
    """The devices allowed at the other end, one line each: `PUBLIC_KEY NAME [HOST:PORT]` (z85 public key as
    `halo-master keygen --device NAME` prints it; a line starting with '# ' is a comment). Revoking a device = deleting
    its line."""

    keys: tuple[AuthorizedKey, ...]
    source: str = ""

    def admits(self, public: bytes) -> bool:
        return any(k.public == public for k in self.keys)

    def server_key(self, endpoint: str) -> bytes:
        """The public key the agent at `endpoint` must present (CURVE checks it in the handshake)."""
        for k in self.keys:
            if k.endpoint == endpoint:
                return k.public
        raise ConfigError(f"agent {endpoint} is not in {self.source or 'the authorized agents'}: add the line "
                          f"`PUBLIC_KEY NAME {endpoint.split('://')[-1]}` that `halo-master keygen --device NAME` printed "
                          "for it (a device not listed, or revoked, is never connected to)")


def load_authorized(path: str | os.PathLike) -> AuthorizedKeys:
    """An authorized-keys file (AuthorizedKeys); ConfigError naming the line that is wrong."""
    from halo.arguments import parse_endpoint

    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the authorized keys {path}: {e}") from None
    keys = []
    for number, line in enumerate(lines, start=1):
        fields = line.split()
        if not fields or fields[0] == "#":  # a comment: '#' and a space (z85 keys may hold a '#', never a space)
            continue
        if len(fields) not in (2, 3) or not is_z85_key(fields[0]):
            raise ConfigError(f"{path}:{number}: expected `PUBLIC_KEY NAME [HOST:PORT]` (a 40-character z85 key), "
                              f"got {line.strip()!r}")
        endpoint = parse_endpoint(fields[2]) if len(fields) == 3 else None
        keys.append(AuthorizedKey(fields[0].encode(), fields[1], endpoint))
    if not keys:
        raise ConfigError(f"{path} authorizes no device: add `PUBLIC_KEY NAME [HOST:PORT]` lines")
    return AuthorizedKeys(tuple(keys), str(path))


@dataclass(frozen=True)
class ClusterKey:
    """A CURVE key pair: the cluster's, shared by every device (device None), or one device's own (`keygen
    --device NAME`), which then trusts only the public keys of its authorized-keys file (`agents`: a master's list of
    its agents, with their addresses)."""

    public: bytes  # z85, 40 bytes
    secret: bytes
    device: str | None = None
    agents: AuthorizedKeys | None = None

    @property
    def udp_key(self) -> bytes:
        """The base of every session's datagram key (wire.session_key): derived from the shared secret; a device key
        has no secret in common with its peers, so its sessions' keys come from the nonce alone (sent encrypted)."""
        if self.device is not None:
            return bytes(32)
        return hashlib.blake2b(self.secret, digest_size=32, person=b"halo-udp-v1").digest()

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.public).hexdigest()[:16]

    def with_agents(self, agents: AuthorizedKeys | None) -> "ClusterKey":
        from dataclasses import replace

        return replace(self, agents=agents)

    def server_key(self, endpoint: str | None) -> bytes:
        """The key an agent at `endpoint` must present: the shared one, or its own from `agents`."""
        if self.agents is not None and endpoint is not None:
            return self.agents.server_key(endpoint)
        if self.device is not None:
            raise ConfigError(f"the device key of {self.device} names no agents: give --authorized-agents FILE "
                              "(their public keys and addresses)")
        return self.public


def generate_key(path: str | os.PathLike, force: bool = False, device: str | None = None) -> ClusterKey:
    """Write a new key file readable by its owner only (0600): the cluster key, or (device) one device's own pair."""
    import zmq

    path = Path(path)
    if path.is_dir():  # (". --force" was a ValueError traceback)
        raise ConfigError(f"{path} is a directory: give the key file's path, e.g. {path / 'cluster.key'}")
    if os.path.lexists(path) and not force:
        raise ConfigError(f"{path} exists; pass --force to replace it (every device then needs the new key)")
    public, secret = zmq.curve_keypair()
    path.parent.mkdir(parents=True, exist_ok=True)
    # a new file beside it, owner-only before a byte is written, then renamed over the name: a symlink planted at
    # `path` is replaced, never followed (writing through it once overwrote its target and chmod-ed that)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "w") as f:
            json.dump({"format": "halo-device-key" if device else "halo-cluster-key", "version": 1,
                       "public": public.decode(), "secret": secret.decode(), **({"device": device} if device else {})}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        if os.path.lexists(partial):
            os.unlink(partial)
    return ClusterKey(public, secret, device)


def is_z85_key(text: str) -> bool:
    """A CURVE key as z85 text: 40 characters that decode to 32 bytes (ZeroMQ raised 'Invalid argument' from deep
    inside a socket option for anything else)."""
    import struct

    from zmq.utils import z85

    try:
        return len(text) == 40 and len(z85.decode(text)) == 32
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, struct.error):
        return False


def load_key(path: str | os.PathLike) -> ClusterKey:
    import zmq

    path = Path(path)
    try:
        mode = path.stat().st_mode
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no cluster key file; create one with `halo-master keygen --out {path}` "
                          "and copy it to every device") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a halo cluster key file ({e})") from None
    except OSError as e:  # a directory, no permission to read it ...
        raise ConfigError(f"{path}: cannot read the key ({e.strerror or e}); give --key the key file") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path}: the cluster key is readable by others (mode {stat.S_IMODE(mode):o}); "
                          f"run chmod 600 {path}")
    try:
        public, secret = raw["public"].encode(), raw["secret"].encode()
    except (KeyError, AttributeError, TypeError):
        raise ConfigError(f"{path}: lacks 'public' and 'secret'") from None
    device = raw.get("device") if raw.get("format") == "halo-device-key" else None
    if raw.get("format") not in ("halo-cluster-key", "halo-device-key") or raw.get("version") != 1 \
            or (raw.get("format") == "halo-device-key" and not (isinstance(device, str) and device)):
        raise ConfigError(f"{path}: not a version-1 halo cluster or device key")
    if not (is_z85_key(public.decode()) and is_z85_key(secret.decode())) or zmq.curve_public(secret) != public:
        raise ConfigError(f"{path}: its public and secret keys are not a CURVE key pair (a damaged or hand-edited "
                          "file): make a new one with `halo-master keygen` and copy it to every device")
    return ClusterKey(public, secret, device)


def master_key(path: str | os.PathLike, authorized_agents: str | os.PathLike | None = None) -> ClusterKey:
    """A master's key pair, with the agents it trusts where a file names them (needed with a device key)."""
    return load_key(path).with_agents(load_authorized(authorized_agents) if authorized_agents else None)


def daemon_keys(path: str | os.PathLike, authorized_masters: str | os.PathLike | None = None):
    """A daemon's key pair and the masters it admits (AuthorizedKeys, or None: the holders of the shared key)."""
    return load_key(path), load_authorized(authorized_masters) if authorized_masters else None


def udp_base_key(key: ClusterKey | None) -> bytes:
    """The base of every session's datagram key (wire.session_key): the key's, or 32 zero bytes in plaintext mode."""
    return key.udp_key if key is not None else bytes(32)


# ---- sockets ---------------------------------------------------------------------------------------------
def server_socket(context, key: ClusterKey | None, insecure: bool = False):
    """The agent's listening socket, a CURVE server with the cluster key. A ROUTER: every message
    arrives with its sender's identity frame and replies go back to exactly that peer, so a master
    that died cannot receive (or steal) the replies meant for its successor."""
    import zmq

    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 30)
    sock.setsockopt(zmq.LINGER, 0)
    if key is None:
        if not insecure:
            raise ConfigError("no cluster key: refusing plaintext; pass --insecure only on a trusted test bed")
        return sock
    sock.curve_server = True
    sock.curve_publickey = key.public
    sock.curve_secretkey = key.secret
    return sock


def client_socket(context, key: ClusterKey | None, insecure: bool = False, endpoint: str | None = None):
    """A master's socket to the agent at `endpoint`: CURVE with our key pair, expecting the agent's key (the shared
    one, or its own from our authorized agents: an agent presenting another fails the handshake)."""
    import zmq

    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if key is None:
        if not insecure:
            raise ConfigError("no cluster key: refusing plaintext; pass --insecure only on a trusted test bed")
        return sock
    sock.curve_serverkey = key.server_key(endpoint)
    sock.curve_publickey = key.public
    sock.curve_secretkey = key.secret
    return sock


def start_authenticator(context, key: ClusterKey, masters: AuthorizedKeys | None = None):
    """ZAP handler: admit only clients presenting the cluster's public key (they must hold its secret), or, given
    `masters` (an agent's authorized-keys file), only the keys listed there."""
    from zmq.auth.thread import ThreadAuthenticator

    if masters is None and key.device is not None:
        raise ConfigError(f"the device key of {key.device} trusts nobody by itself: give --authorized-masters FILE "
                          "(the public keys of the masters allowed to use this device)")
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_Admits(masters, key.public))
    return auth


class _Admits:
    """pyzmq's ZAP credentials provider: called with the client's z85 public key."""

    def __init__(self, masters: AuthorizedKeys | None, shared: bytes):
        self.masters, self.shared = masters, shared

    def callback(self, domain, key) -> bool:
        return self.masters.admits(bytes(key)) if self.masters is not None else bytes(key) == self.shared
