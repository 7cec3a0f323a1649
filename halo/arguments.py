"""Values people type (agent addresses, counts, rates), checked in one place for halo-master, halo-agent
and the cluster files, so a bad value ends in one line that names it and exit code 2.

Addresses: ZeroMQ takes many malformed endpoints without a word (port 70000 silently becomes 4464,
"tcp://:5" connects nowhere) or fails late with a bare "Invalid argument", so they are parsed here first.
halo's UDP side speaks IPv4, so a host is an IPv4 address or a host name ("*" too where one listens).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import numbers
import re
import socket
from pathlib import Path
from typing import Callable

from halo.errors import ConfigError

HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")
MAX_THREADS = 1024
EXAMPLE = "e.g. 192.168.1.20:7070 or pi-1.local:7070"


def parse_endpoint(text: str, listen: bool = False) -> str:
    """HOST:PORT or tcp://HOST:PORT as the canonical "tcp://HOST:PORT"; ConfigError naming what is wrong.
    listen=True: where an agent binds, so HOST may be "*" and PORT 0 (any free port), and HOST must be local."""
    if not isinstance(text, str):
        raise ConfigError(f"address {text!r} is not a string ({EXAMPLE})")
    rest = text.strip()
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme != "tcp":
            raise ConfigError(f"address {text!r}: only tcp:// is supported ({EXAMPLE})")
    host, colon, port_text = rest.rpartition(":")
    if not colon or not host:
        raise ConfigError(f"address {text!r} is not HOST:PORT ({EXAMPLE})")
    if host.startswith("[") or ":" in host:
        raise ConfigError(f"address {text!r}: IPv6 addresses are not supported; use an IPv4 address or a host name")
    if not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5) \
            or not (0 if listen else 1) <= int(port_text) <= 65535:
        low = "0 (any free port)" if listen else "1"
        raise ConfigError(f"address {text!r}: port {port_text!r} is not a number from {low} to 65535")
    port = int(port_text)
    if host != "*" or not listen:
        if not _is_ipv4(host) and (not HOSTNAME.match(host) or re.fullmatch(r"[0-9.]+", host)):
            raise ConfigError(f"address {text!r}: {host!r} is neither an IPv4 address nor a host name ({EXAMPLE})")
        if listen:
            try:
                socket.getaddrinfo(host, None, socket.AF_INET)
            except (OSError, UnicodeError):
                raise ConfigError(f"cannot listen on {text!r}: {host!r} is not an address of this machine "
                                  "(use * for all interfaces, or one of its IPv4 addresses)") from None
    return f"tcp://{host}:{port}"


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether a host name or address names this machine's loopback (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_host(endpoint: str) -> str:
    """The host of a "tcp://HOST:PORT" endpoint (parse_endpoint's form)."""
    return endpoint.split("://", 1)[-1].rsplit(":", 1)[0]


def check_insecure(endpoints: list[str], insecure_lan: bool, who: str) -> None:
    """Plaintext (--insecure) only between loopback addresses unless --insecure-lan says otherwise: without the key
    anyone on the network can act as master, forge datagrams under any sender id, and read every hidden state."""
    exposed = [e for e in endpoints if not is_loopback(endpoint_host(e))]
    if exposed and not insecure_lan:
        raise ConfigError(f"--insecure {who} {', '.join(exposed)}, which is not a loopback address: anyone who can "
                          "reach it could take over the cluster. Use a cluster key (halo-master keygen), or add "
                          "--insecure-lan if this network is a trusted test bed")


DEFAULT_KEY = "/etc/halo/cluster.key"


def add_master_key_arguments(parser) -> None:
    """How a master authenticates to its agents (generate, serve, status, plan): one set of flags, one meaning."""
    parser.add_argument("--key", default=DEFAULT_KEY, help="the cluster key, or this master's device key (halo-master "
                        f"keygen --device NAME) (default {DEFAULT_KEY})")
    parser.add_argument("--authorized-agents", metavar="FILE",
                        help="the agents this master trusts, a line `PUBLIC_KEY NAME HOST:PORT` each (needed with a "
                             "device key; revoking an agent = deleting its line): an agent presenting another key at "
                             "that address is refused")
    parser.add_argument("--insecure", action="store_true", help="talk plaintext to agents started with --insecure "
                        "(loopback addresses only, unless --insecure-lan)")
    parser.add_argument("--insecure-lan", action="store_true",
                        help="with --insecure: also to agents beyond this machine (a trusted test bed only: anyone on "
                             "the network can then read, forge and take over the cluster's traffic)")


def add_daemon_key_arguments(parser, key_default: str | None = DEFAULT_KEY) -> None:
    """How a daemon (halo-agent, halo-stage-worker) authenticates the masters it serves. key_default None: the
    caller fills it (halo-agent: its config file, then DEFAULT_KEY)."""
    parser.add_argument("--key", default=key_default, help=f"the cluster key, or this device's own key (halo-master "
                        f"keygen --device NAME) (default {DEFAULT_KEY})")
    parser.add_argument("--authorized-masters", metavar="FILE",
                        help="the masters allowed to use this device, a line `PUBLIC_KEY NAME` each (needed with a "
                             "device key; revoking one = deleting its line); with the shared cluster key, if given, "
                             "only these too")
    parser.add_argument("--insecure", action="store_true", help="no key, plaintext: only on a loopback --listen address, "
                        "unless --insecure-lan")
    parser.add_argument("--insecure-lan", action="store_true",
                        help="with --insecure: listen beyond this machine too (a trusted test bed only: anyone on the "
                             "network can then act as master and forge datagrams; said in the log and in status)")


def parse_endpoints(text: str) -> list[str]:
    """A comma-separated list of agent addresses, each checked, none twice."""
    endpoints = [parse_endpoint(part) for part in text.split(",") if part.strip()]
    if not endpoints:
        raise ConfigError(f"no agent addresses in {text!r} ({EXAMPLE}, comma-separated)")
    repeated = sorted({e for e in endpoints if endpoints.count(e) > 1})
    if repeated:
        raise ConfigError(f"agent address {repeated[0]} is given more than once")
    return endpoints


def check_path(option: str, path: str | None, kind: str) -> None:
    """A path given on the command line exists (checked before anything slow starts)."""
    if path is None:
        return
    try:
        exists = Path(path).exists()
    except OSError as e:  # e.g. a name too long for the file system
        raise ConfigError(f"{option} {path[:200]}: {e.strerror or e}") from None
    if not exists:
        raise ConfigError(f"{option} {path}: no such {kind}")


def check_integer(value, what: str = "", low: int | None = None, high: int | None = None) -> int:
    """An integer within [low, high] (bounds optional); bools and floats are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{what} must be an integer, got {value!r}".lstrip())
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"from {low} to {high}" if low is not None and high is not None else \
            f">= {low}" if low is not None else f"<= {high}"
        raise ConfigError(f"{what} must be {bounds}, got {value}".lstrip())
    return int(value)


def check_number(value, what: str = "", low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> float:
    """A finite number within the bounds (each one open or closed)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value):
        raise ConfigError(f"{what} must be a finite number, got {value!r:.40}".lstrip())
    too_low = low is not None and (value < low or (low_open and value == low))
    too_high = high is not None and (value > high or (high_open and value == high))
    if too_low or too_high:
        if low is not None and high is not None:
            bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            bounds = f"{'>' if low_open else '>='} {low:g}"
        else:
            bounds = f"{'<' if high_open else '<='} {high:g}"
        raise ConfigError(f"{what} must be {bounds}, got {value:g}".lstrip())
    return float(value)


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float (memory_mb = 1 and 400 zeros was an OverflowError traceback)
        return False


# ---- argparse ------------------------------------------------------------------------------------------------
class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad value ends in a single line naming it (not the whole usage) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def argument(parse: Callable[[str], object], name: str) -> Callable[[str], object]:
    """An argparse `type=` from a parse function that raises ConfigError (or ValueError)."""
    def convert(text: str):
        try:
            return parse(text)
        except (ConfigError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = name  # argparse names the type in "invalid <name> value" messages
    return convert


def _to_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not an integer") from None


def _to_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a number") from None


def integer(low: int | None = None, high: int | None = None):
    """argparse type: an integer within [low, high]."""
    return argument(lambda text: check_integer(_to_int(text), "", low, high), "integer")


def number(low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False):
    """argparse type: a finite number within the bounds."""
    return argument(lambda text: check_number(_to_float(text), "", low, high, low_open, high_open), "number")


endpoint_argument = argument(parse_endpoint, "address")
listen_argument = argument(lambda text: parse_endpoint(text, listen=True), "address")
endpoints_argument = argument(parse_endpoints, "addresses")
