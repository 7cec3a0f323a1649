"""What every halo daemon does on its control socket (halo-agent and halo-stage-worker alike).

It holds a local copy of the model (and its sha256, which masters must match), listens as a CURVE
server with the cluster key (plaintext only when told: --insecure), logs every refused security
handshake with the peer's address, and answers messages one at a time: each is decoded and
validated, handed to the daemon's `handle`, and answered. A malformed message, a refused request or
a bug is answered with an error and logged; nothing a peer sends ends the daemon. SIGTERM drains:
the current message is answered, then the daemon leaves.
"""

from __future__ import annotations

import logging
import os
import signal
import socket as sockets
import sys
import threading

from halo.errors import HaloError
from halo.sync.framing import FramingError
from halo.transport.reliable import Message, MessageError, decode, encode, server_socket, start_authenticator

log = logging.getLogger("halo.daemon")


def start_failed(prog: str, listen: str, error: Exception) -> int:
    """The one line a daemon that could not start prints (a port in use, an unreadable file), and its exit status."""
    import errno

    import zmq

    if isinstance(error, zmq.ZMQError) or getattr(error, "errno", None) in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
        print(f"{prog}: error: cannot listen on {listen}: {error} (is another {prog} using the port? choose another "
              "with --listen)", file=sys.stderr)
    else:
        print(f"{prog}: error: {error}", file=sys.stderr)
    return 2


class ControlServer:
    """Subclasses implement `handle(message, peer, address)` and may add sockets to `poll_sources` and work
    to `tick(events)` (called after every poll)."""

    def __init__(self, model_path: str | None, listen: str, key, insecure: bool, name: str, masters=None):
        """masters: the authorized-keys file's keys (transport/reliable.py AuthorizedKeys) of the masters this daemon
        admits; None: the holders of the shared cluster key."""
        import zmq

        from halo.model.loader import load_weights, model_fingerprint

        self.weights = load_weights(model_path)
        self.model_sha256 = model_fingerprint(self.weights.source)
        self.name = name
        self.context = zmq.Context()
        self.auth = start_authenticator(self.context, key, masters) if key else None
        self.socket = server_socket(self.context, key, insecure)
        self.insecure = insecure  # plaintext: said in the log and in status
        if insecure:
            log.warning("%s runs WITHOUT a cluster key (--insecure): anyone who reaches %s can act as its master and "
                        "forge its datagrams", name, listen)
        self.monitor = self.socket.get_monitor_socket()  # refused handshakes are logged with the peer's address
        if listen.endswith(":0"):
            port = self.socket.bind_to_random_port(listen.rsplit(":", 1)[0])
            self.endpoint = f"{listen.rsplit(':', 1)[0]}:{port}"
        else:
            self.socket.bind(listen)
            self.endpoint = listen
        self.running = True
        self.refused_handshakes = 0
        self._last_peer = "an unknown address"  # of the newest connection (a failed handshake follows its accept)
        self._watcher = threading.Thread(target=self._watch_connections, name="halo-connections", daemon=True)
        # before anyone can learn our address: a SIGTERM from then on drains instead of killing
        signal.signal(signal.SIGTERM, self.stop)

    def stop(self, *_) -> None:
        self.running = False

    def run_command(self, command: str) -> int:
        """The daemon as a command (halo-agent, halo-stage-worker): its LISTENING line, then serve until stopped ->
        the exit code. Ctrl-C drains as SIGTERM does (the first one printed a KeyboardInterrupt traceback); a
        second one interrupts at once ("interrupted", 130)."""
        def interrupted(*_):
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.stop()

        signal.signal(signal.SIGINT, interrupted)  # before anyone learns our address
        print(f"LISTENING {self.endpoint}", flush=True)
        try:
            self.serve()
        except KeyboardInterrupt:
            print(f"{command}: interrupted", file=sys.stderr)
            return 130
        return 0

    def poll_sources(self) -> list:
        """Sockets or file descriptors to wait on beside the control socket."""
        return []

    def wait(self, poller) -> dict:
        """The next events of the control socket and poll_sources (200 ms at most)."""
        return dict(poller.poll(200))

    def tick(self, events: dict) -> None:
        """After every poll (200 ms at most): the events of poll_sources, or an empty dict."""

    def handle(self, message: Message, peer: bytes, address: str | None) -> Message | None:
        raise NotImplementedError

    def recover(self) -> None:
        """After tick failed: drop what it was serving (its state may be half-updated)."""

    def serve(self) -> None:
        import zmq

        log.info("%s listening on %s (model %s, sha256 %s...)", self.name, self.endpoint, self.weights.source,
                 self.model_sha256[:12])
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        for source in self.poll_sources():
            poller.register(source, zmq.POLLIN)
        self._watcher.start()
        while self.running:
            events = self.wait(poller)
            try:
                self.tick(events)
            except Exception:  # a bug must not take the daemon down: what the tick served is ended instead
                log.exception("unexpected error between messages: the session ends, the daemon goes on")
                self.recover()
            if self.socket in events:
                self._receive()
        log.info("%s stopping", self.name)
        self.close()

    def _receive(self) -> None:
        """One control message: handled, answered; nothing a peer sends takes the daemon down."""
        import zmq

        identity, *frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        call = None
        try:
            message = decode([f.buffer for f in frames])
            call = message.fields.get("call")
            reply = self.handle(message, identity.bytes, frames[0].get("Peer-Address"))
        except (MessageError, FramingError) as e:  # (a field no sync point or frame can have: an epoch of -1)
            log.warning("refused a malformed message: %s", e)
            reply = Message("error", {"reason": f"malformed message: {e}"})
        except HaloError as e:
            self.count_error()
            log.warning("error: %s", e)
            reply = Message("error", {"reason": str(e)})
        except Exception as e:  # a bug must not take the daemon down mid-cluster
            log.exception("unexpected error while handling a message")
            reply = Message("error", {"reason": f"{self.name} error: {type(e).__name__}: {e}"})
        if reply is not None:
            if type(call) is int:  # echoed: a client that re-uses a connection tells a late reply from this one's
                reply = Message(reply.kind, {**reply.fields, "call": call}, reply.arrays)
            self.socket.send_multipart([identity.bytes, *encode(reply)])

    def reply(self, peer: bytes, message: Message) -> None:
        """A message to `peer` outside the request it answers (progress reports, an answer that took a thread)."""
        self.socket.send_multipart([peer, *encode(message)])

    def count_error(self) -> None:
        """A request failed with a domain error (subclasses count it)."""

    def _watch_connections(self) -> None:
        """Log masters whose security handshake failed (another key, or plaintext against our key), with their
        address, so a user can tell a wrong key from a dead device. A thread of its own: the address is read
        from the connection's descriptor right when it is accepted, before a failed handshake closes it."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while self.running:
            try:
                if not self.monitor.poll(200):
                    continue
                event = recv_monitor_message(self.monitor)
            except zmq.ZMQError:
                return  # closing
            kind, value = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:  # value: the connection's file descriptor, still open now
                try:
                    with sockets.socket(fileno=os.dup(value)) as conn:
                        self._last_peer = "%s:%d" % conn.getpeername()[:2]
                except OSError:
                    self._last_peer = "an unknown address"
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                          zmq.EVENT_HANDSHAKE_FAILED_AUTH):  # value: the protocol error
                if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # no refusal: the exchange broke off (errno)
                    log.info("a security handshake from %s broke off (%s): a lossy or slow link, or the master "
                             "went away mid-handshake; it reconnects by itself", self._last_peer,
                             os.strerror(value) if value else "no reason given")
                    continue
                if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                    reason = "it does not use the same security (plaintext --insecure against the cluster key, or the reverse)"
                else:
                    reason = "it holds another cluster key, or runs plaintext (--insecure)"
                self.refused_handshakes += 1
                log.warning("refused a connection from %s: %s", self._last_peer, reason)

    def close(self) -> None:
        self.running = False
        if self._watcher.is_alive():
            self._watcher.join(timeout=1.0)
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        if self.auth:
            self.auth.stop()
        self.context.destroy(linger=0)
