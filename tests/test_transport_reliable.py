"""The control plane: CURVE-authenticated pyzmq, key files, and the validating message codec."""

import os
import stat

import numpy as np
import pytest
import zmq

from halo.errors import ConfigError
from halo.transport.reliable import (ClusterKey, Message, MessageError, client_socket, decode, encode, generate_key,
                                     load_key, server_socket, start_authenticator)


@pytest.fixture
def key(tmp_path):
    return generate_key(tmp_path / "cluster.key")


def test_key_file_is_private_and_round_trips(tmp_path, key):
    path = tmp_path / "cluster.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_key(path) == key and len(key.udp_key) == 32
    with pytest.raises(ConfigError, match="pass --force"):
        generate_key(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_key(path)
    with pytest.raises(ConfigError, match="halo-master keygen"):
        load_key(tmp_path / "missing.key")


def exchange(server_key, client_key, insecure=False, timeout_ms=1500):
    context = zmq.Context()
    auth = start_authenticator(context, server_key) if server_key else None
    try:
        server = server_socket(context, server_key, insecure)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = client_socket(context, client_key, insecure)
        if client_key is None and server_key is not None:
            pass  # a plaintext client against a CURVE server
        client.connect(f"tcp://127.0.0.1:{port}")
        # a DEALER whose only connection failed its handshake has no peer to queue to: send would wait forever
        client.setsockopt(zmq.SNDTIMEO, timeout_ms)
        try:
            client.send_multipart(encode(Message("hello", {"n": 1}, [np.arange(4, dtype=np.float32)])))
        except zmq.Again:
            return None
        if server.poll(timeout_ms):
            return decode(server.recv_multipart()[1:])  # ROUTER: the first frame is the peer's identity
        return None
    finally:
        if auth:
            auth.stop()
        context.destroy(linger=0)


def test_master_with_the_cluster_key_is_heard(key):
    message = exchange(key, key)
    assert message.kind == "hello" and message.fields == {"n": 1}
    np.testing.assert_array_equal(message.arrays[0], np.arange(4, dtype=np.float32))


def test_master_with_another_key_is_refused(key, tmp_path):
    other = generate_key(tmp_path / "other.key")
    impostor = ClusterKey(other.public, other.secret)
    # knows the agents' public key but not the cluster secret
    import halo.transport.reliable as r

    context = zmq.Context()
    auth = start_authenticator(context, key)
    try:
        server = server_socket(context, key)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = context.socket(zmq.DEALER)
        client.curve_serverkey, client.curve_publickey, client.curve_secretkey = key.public, impostor.public, impostor.secret
        client.connect(f"tcp://127.0.0.1:{port}")
        client.setsockopt(zmq.SNDTIMEO, 800)  # (its handshake fails: with no peer left, send would wait forever)
        try:
            client.send_multipart(r.encode(Message("hello")))
        except zmq.Again:
            pass
        assert server.poll(800) == 0
    finally:
        auth.stop()
        context.destroy(linger=0)


def test_plaintext_needs_an_explicit_opt_in(key):
    with pytest.raises(ConfigError, match="refusing plaintext"):
        server_socket(zmq.Context.instance(), None)
    assert exchange(None, None, insecure=True).kind == "hello"
    assert exchange(key, None, insecure=True) is None  # a plaintext master cannot talk to a CURVE agent


@pytest.mark.parametrize("frames, message", [
    ([b"HALO\x01"], "at least 2 frames"),
    ([b"XXXX\x01", b"{}"], "bad preamble"),
    ([b"HALO\x09", b"{}"], "protocol version 9"),
    ([b"HALO\x01", b"{}"], "protocol version 1 but this halo speaks 2"),  # a peer of control protocol 1
    ([b"HALO\x02", b"{not json"], "malformed header"),
    ([b"HALO\x02", b'{"kind": "x", "fields": {}, "arrays": [["float32", [4]]]}'], "announces 1 arrays but 0"),
    ([b"HALO\x02", b'{"kind": "x", "fields": {}, "arrays": [["float32", [4]]]}', b"\0" * 15], "needs 16 bytes"),
    ([b"HALO\x02", b'{"kind": "x", "fields": {}, "arrays": [["object", [1]]]}', b"\0" * 8], "not allowed"),
    ([b"HALO\x02", b'{"kind": "x", "fields": {}, "arrays": [["float32", [1048576, 1048576]]]}', b""], "needs"),
])
def test_malformed_messages_are_refused_with_a_reason(frames, message):
    with pytest.raises(MessageError, match=message):
        decode(frames)


def test_keygen_command(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "k" / "cluster.key"
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "keygen", "--out", str(path)], capture_output=True,
                         text=True, timeout=60, check=True)
    assert "fingerprint" in out.stdout and load_key(path).fingerprint in out.stdout
    again = subprocess.run([sys.executable, "-m", "halo.cli.master", "keygen", "--out", str(path)], capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 2 and "--force" in again.stderr


def test_keygen_replaces_a_planted_symlink_instead_of_writing_through_it(tmp_path):
    """--force once opened the name with O_TRUNC: a symlink there had its target overwritten and chmod-ed."""
    victim = tmp_path / "victim.conf"
    victim.write_text("keep me\n")
    victim.chmod(0o644)
    path = tmp_path / "cluster.key"
    path.symlink_to(victim)
    with pytest.raises(ConfigError, match="--force"):  # a dangling or live link counts as existing
        generate_key(path)
    key = generate_key(path, force=True)
    assert victim.read_text() == "keep me\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_key(path).fingerprint == key.fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.key", "victim.conf"]  # no partial left
    os.unlink(path)


def test_a_damaged_key_file_or_a_directory_is_one_clear_error(tmp_path, key):
    """A key whose public half does not match its secret was taken for another cluster's ("copy the coordinator's
    cluster.key", though both ends held the same file); text that is not z85 failed inside ZeroMQ ("Invalid
    argument", blamed on the port by the agent); --key DIR was an IsADirectoryError traceback; keygen --out . --force
    a ValueError."""
    import json

    other = zmq.curve_keypair()[0].decode()
    for edit in ({"public": other}, {"secret": "~" * 40}, {"version": 7}):
        path = tmp_path / f"bad-{len(edit)}-{next(iter(edit))}.key"
        raw = {"format": "halo-cluster-key", "version": 1, "public": key.public.decode(), "secret": key.secret.decode()}
        path.write_text(json.dumps({**raw, **edit}))
        os.chmod(path, 0o600)
        with pytest.raises(ConfigError, match="not a CURVE key pair|not a version-1"):
            load_key(path)
    with pytest.raises(ConfigError, match="cannot read the key"):
        load_key(tmp_path)
    with pytest.raises(ConfigError, match="is a directory: give the key file's path"):
        generate_key(tmp_path, force=True)
