"""What a master and an agent say to each other to start a session, as frozen dataclasses: the sender builds one, the
receiver takes one only through `from_fields`, which checks every field's type and shape, and the ranges it can know
without the model (group indices are checked against the model's layout by the agent), and names the one at fault,
so a malformed or forged request is refused whole and never half-used.

Control protocol 2 (transport/reliable.py PROTOCOL_VERSION): a peer of another version is refused by the codec,
before any message is read, with the version it speaks. Version 2 dropped what version 1 negotiated: every agent
fills KV caches from recorded inputs and takes the ranking an MLP input carries, and every master's hello and profile
request names its UDP wire version.

    master -> agent   profile  ProfileRequest     agent -> master   profile {name, profile, measured, udp_port}
    master -> agent   hello    Hello              agent -> master   loading ..., then ready (Ready) or refused
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from halo.compute.batch import MAX_SLOTS
from halo.errors import HaloError

from halo.transport import wire

MAX_NAME = 256  # characters of a device or master name


class ControlError(HaloError):
    """A control message that cannot be taken: the field at fault and why."""


def _int(f: dict, name: str, low: int, high: int) -> int:
    value = f.get(name)
    if type(value) is not int or not low <= value <= high:
        raise ControlError(f"{name} must be an integer within {low}..{high}, got {value!r}")
    return value


def _bool(f: dict, name: str) -> bool:
    value = f.get(name)
    if type(value) is not bool:
        raise ControlError(f"{name} must be true or false, got {value!r}")
    return value


def _text(f: dict, name: str, limit: int = MAX_NAME) -> str:
    value = f.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise ControlError(f"{name} must be a string of 1..{limit} characters, got {str(value)[:40]!r}")
    return value


def _hex(f: dict, name: str, digits: int) -> str:
    value = f.get(name)
    if not isinstance(value, str) or len(value) != digits or any(c not in "0123456789abcdef" for c in value):
        raise ControlError(f"{name} must be {digits} lowercase hex digits, got {str(value)[:40]!r}")
    return value


def _dict(f: dict, name: str) -> dict:
    value = f.get(name)
    if not isinstance(value, dict):
        raise ControlError(f"{name} must be an object, got {type(value).__name__}")
    return value


def _ids(value, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(type(v) is not int or v < 0 for v in value):
        raise ControlError(f"{name} must be a list of group indices (integers >= 0)")
    return tuple(value)


def _layers(f: dict, name: str) -> tuple[tuple[int, ...], ...]:
    value = f.get(name)
    if not isinstance(value, list):
        raise ControlError(f"{name} must be a list of each layer's groups")
    return tuple(_ids(v, f"{name}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class UdpSession:
    """The UDP session a master opens: its id, the nonce its key is derived with, the master's port, the wire version."""

    session: int
    nonce: str  # hex, wire.NONCE_BYTES bytes
    port: int
    wire_version: int = wire.VERSION

    def to_fields(self) -> dict:
        return {"udp_session": self.session, "udp_nonce": self.nonce, "udp_port": self.port,
                "udp_wire": self.wire_version}

    @classmethod
    def from_fields(cls, f: dict) -> "UdpSession | None":
        """None where the message opens no UDP session (tcp sync without link probes)."""
        if "udp_session" not in f:
            return None
        version = _int(f, "udp_wire", 0, 255)
        if version != wire.VERSION:
            raise ControlError(f"UDP wire version {version} but this agent speaks {wire.VERSION}: run the same halo "
                               "version on the master and every agent")
        return cls(_int(f, "udp_session", 1, (1 << 32) - 1), _hex(f, "udp_nonce", 2 * wire.NONCE_BYTES),
                   _int(f, "udp_port", 1, 65535), version)


def _udp_fields(udp: UdpSession | None) -> dict:
    return udp.to_fields() if udp is not None else {}


@dataclass(frozen=True)
class ProfileRequest:
    """A master about to plan asks an agent to measure itself (kernels, memory) and to echo its link probes."""

    model_sha256: str
    weights: str
    mlp_group_size: int
    vocab_group_size: int
    master: str
    take_over: bool  # an agent serving another master ends that session (this one says hello next)
    fresh: bool  # re-run cached benchmarks
    node_id: int
    udp: UdpSession | None = None

    def to_fields(self) -> dict:
        fields = asdict(self)
        del fields["udp"]
        return {**fields, **_udp_fields(self.udp)}

    @classmethod
    def from_fields(cls, f: dict) -> "ProfileRequest":
        udp = UdpSession.from_fields(f)
        return cls(_hex(f, "model_sha256", 64), _text(f, "weights", 16), _int(f, "mlp_group_size", 1, 1 << 20),
                   _int(f, "vocab_group_size", 1, 1 << 20), _text(f, "master"), _bool(f, "take_over"),
                   _bool(f, "fresh"), _int(f, "node_id", 1 if udp else 0, 254), udp)


@dataclass(frozen=True)
class Hello:
    """A master's plan for one agent: the model, the share of neuron groups, the sync settings, the UDP session."""

    model_sha256: str
    context: int
    mlp_group_size: int
    vocab_group_size: int
    master: str
    weights: str
    sync: dict  # SyncSettings.to_json(): validated by SyncSettings.from_json where it is used
    node_id: int
    attention: tuple[tuple[int, ...], ...]  # per layer: the query heads
    mlp: tuple[tuple[int, ...], ...]  # per layer: the MLP groups
    lm_head: tuple[int, ...]  # the LM-head (vocabulary) groups
    udp: UdpSession | None = None
    slots: int = 1  # KV caches per attention shard: sequences a batched pass may carry (halo/compute/batch.py)

    def to_fields(self) -> dict:
        return {"model_sha256": self.model_sha256, "context": self.context, "slots": self.slots,
                "mlp_group_size": self.mlp_group_size,
                "vocab_group_size": self.vocab_group_size, "master": self.master, "weights": self.weights,
                "sync": self.sync, "node_id": self.node_id, "attention": [list(g) for g in self.attention],
                "mlp": [list(g) for g in self.mlp], "lm_head": list(self.lm_head), **_udp_fields(self.udp)}

    @classmethod
    def from_fields(cls, f: dict) -> "Hello":
        udp = UdpSession.from_fields(f)
        return cls(_hex(f, "model_sha256", 64), _int(f, "context", 1, 1 << 24), _int(f, "mlp_group_size", 1, 1 << 20),
                   _int(f, "vocab_group_size", 1, 1 << 20), _text(f, "master"), _text(f, "weights", 16),
                   _dict(f, "sync"), _int(f, "node_id", 1 if udp else 0, 254), _layers(f, "attention"),
                   _layers(f, "mlp"), _ids(f.get("lm_head"), "lm_head"), udp,
                   _int(f, "slots", 1, MAX_SLOTS) if "slots" in f else 1)

    @property
    def share(self) -> dict:
        """The groups as halo.compute.shares.Shares takes them."""
        return {"attention": [list(g) for g in self.attention], "mlp": [list(g) for g in self.mlp],
                "lm_head": list(self.lm_head)}


@dataclass(frozen=True)
class Ready:
    """An agent's answer once its share is built."""

    name: str
    weight_bytes: int
    profile: dict
    udp_port: int | None
    kept_groups: int  # groups whose kernels it kept from its previous session (a sticky re-plan)
    loads_ahead: bool  # HALO: it reads its next layer's groups from storage as soon as it predicts them
    slots: int = 1  # the KV-cache slots it keeps (an agent older than batched passes says nothing: one)

    def to_fields(self) -> dict:
        return asdict(self)

    @classmethod
    def from_fields(cls, f: dict) -> "Ready":
        port = f.get("udp_port")
        return cls(_text(f, "name"), _int(f, "weight_bytes", 0, 1 << 50), _dict(f, "profile"),
                   None if port is None else _int(f, "udp_port", 1, 65535), _int(f, "kept_groups", 0, 1 << 30),
                   _bool(f, "loads_ahead"), _int(f, "slots", 1, MAX_SLOTS) if "slots" in f else 1)
