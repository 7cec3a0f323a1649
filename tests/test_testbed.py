"""The namespace test bed puts real, silent loss on real sockets (skips where namespaces cannot be made)."""

import os
import subprocess
import sys

import pytest

from halo.rpi.testbed import LossyTestbed, available

OK, WHY = available()
PREFIX = f"ht{os.getpid() % 100000}"  # unique per test run: concurrent runs never share devices
pytestmark = pytest.mark.skipif(not OK, reason=f"namespace test bed unavailable: {WHY}")

COUNTER = """
import socket, sys, time
role, address = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
if role == "recv":
    s.bind((address, 9999)); s.settimeout(1.0); n = 0
    print("ready", flush=True)
    try:
        while True:
            s.recv(2000); n += 1
    except socket.timeout:
        pass
    print(n)
else:
    for _ in range(2000):
        s.sendto(b"x" * 1000, (address, 9999)); time.sleep(0.0001)
"""


def namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_loss_is_real_silent_and_counted():
    with LossyTestbed(1, prefix=PREFIX) as bed:
        bed.set_loss(0.2)
        receiver = bed.popen("agent-1", [sys.executable, "-c", COUNTER, "recv", bed.address("agent-1")],
                             stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "ready"  # bound before anything is sent
        sender = bed.popen("master", [sys.executable, "-c", COUNTER, "send", bed.address("agent-1")])
        assert sender.wait(timeout=30) == 0  # sendto never failed: the loss is silent
        received = int(receiver.communicate(timeout=30)[0].split()[-1])
        assert 1400 < received < 1800  # about 80 % of 2000
        assert bed.drop_counters()["agent-1"] >= 2000 - received
    assert f"{PREFIX}-" not in namespaces()


SEGMENTED = """
import socket, sys, time
from halo.transport import wire
role, address = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
if role == "recv":
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22); s.bind((address, 9999)); s.settimeout(1.0)
    per_vector = {}
    print("ready", flush=True)
    try:
        while True:
            v = int.from_bytes(s.recv(2000)[:4], "little"); per_vector[v] = per_vector.get(v, 0) + 1
    except socket.timeout:
        pass
    print(sum(0 < n < 6 for n in per_vector.values()), sum(per_vector.values()))
else:
    for v in range(300):
        wire._datagrams.sendmany(s.fileno(), [v.to_bytes(4, "little") * 350] * 6, [(address, 9999)], True)
        time.sleep(0.0005)
"""


def test_a_segmented_send_loses_its_datagrams_one_by_one():
    """UDP GSO (transport/udp/) hands the kernel 6 datagrams as one send: on the bed each must still cross the 'radio' as
    its own frame, lost or not on its own. With UDP segmentation left on on the veths it crossed as one frame and a
    vector came whole or not at all (the bed lied: 0 partial vectors in 3,000 at 5 %)."""
    from halo.transport import wire

    if wire._datagrams is None:
        pytest.skip("halo.transport._datagrams is not built: no segmented sends to check")
    with LossyTestbed(1, prefix=PREFIX) as bed:
        bed.set_loss(0.3)
        receiver = bed.popen("agent-1", [sys.executable, "-c", SEGMENTED, "recv", bed.address("agent-1")],
                             stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "ready"
        sender = bed.popen("master", [sys.executable, "-c", SEGMENTED, "send", bed.address("agent-1")])
        assert sender.wait(timeout=30) == 0
        partial, received = map(int, receiver.communicate(timeout=30)[0].split())
    assert 1000 < received < 1500  # about 70 % of 1,800 datagrams
    assert partial > 150  # 1 - 0.7^6 - 0.3^6 = 88 % of 300 vectors lose some but not all of their 6 datagrams


def test_fast_path_loses_nothing_at_five_percent():
    from halo.eval.bench_transport import run_setting

    with LossyTestbed(2, prefix=PREFIX) as bed:
        bed.set_loss(0.05)
        result = run_setting(bed, 2, 2048, "fast", rounds=40, time_limit=20, key=os.urandom(32).hex())
    assert result["delivered"] == 1.0 and result["rounds"] == 40


def test_a_process_in_a_namespace_sees_its_own_cgroup_memory_limit():
    """An emulated device in the bed, in its own memory cgroup (rpi/limits.py), budgets from that limit: the bed enters
    only the network namespace (`ip netns exec` remounted /sys and hid /sys/fs/cgroup, so an agent saw no limit and
    budgeted from the machine's free memory)."""
    from halo.rpi.limits import DeviceLimits, available as limits_available

    ok, why = limits_available()
    if not ok:
        pytest.skip(f"memory cgroups unavailable: {why}")
    code = ("import socket; from halo.host.memory import memory_limit; s = socket.socket(socket.AF_INET, "
            "socket.SOCK_DGRAM); s.bind((__import__('sys').argv[1], 0)); print(memory_limit()[0])")
    with LossyTestbed(1, prefix=PREFIX) as bed, DeviceLimits(f"{PREFIX}-tb", 300 << 20) as limits:
        out = bed.popen("agent-1", [sys.executable, "-P", "-c", code, bed.address("agent-1")], preexec_fn=limits.join,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True).communicate(timeout=60)
        assert out[0].split() == [str(300 << 20)], out[1]  # bound to the namespace's own address, and saw the limit


def test_a_second_bed_of_the_same_prefix_is_refused_while_the_first_is_up():
    """It removed the live bed's namespaces and links as "leftovers of a crashed run", without a word."""
    with LossyTestbed(1, prefix=PREFIX) as bed:
        with pytest.raises(RuntimeError, match="is up in another process"):
            _enter_elsewhere()
        assert f"{PREFIX}-a1" in namespaces() and bed.hosts


def _enter_elsewhere():
    done = subprocess.run([sys.executable, "-c", f"from halo.rpi.testbed import LossyTestbed\n"
                           f"LossyTestbed(1, prefix={PREFIX!r}).__enter__()"], capture_output=True, text=True, timeout=60)
    raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.returncode else "the second bed was built")


def test_loss_settings_are_checked_before_the_rules_change():
    """set_loss(p, hosts=[]) put loss on every agent; a bad host or rate flushed the rules and applied half the new
    ones; 0.9996 passed the check and failed inside nft; 0.0004 installed nothing without a word."""
    with LossyTestbed(2, prefix=PREFIX) as bed:
        bed.set_losses({"agent-1": 0.2})
        for bad in ({"agent-1": 0.1, "agent-9": 0.1}, {"agent-2": 0.9996}, {"agent-2": 0.0004}):
            with pytest.raises(ValueError):
                bed.set_losses(bad)
        rules = subprocess.run(["nft", "list", "chain", "bridge", bed.table, "forward"], capture_output=True,
                               text=True).stdout
        assert rules.count("numgen random mod 1000 < 200") == 2 and f"{PREFIX}-v2" not in rules  # the old ones kept
        bed.set_loss(0.1, hosts=[])
        assert "numgen" not in subprocess.run(["nft", "list", "chain", "bridge", bed.table, "forward"],
                                              capture_output=True, text=True).stdout


def test_sigterm_and_started_processes_leave_nothing_behind(tmp_path):
    """SIGTERM (timeout, a CI cancel) left every namespace, link and nft table; a process popen started outlived the
    bed, keeping its namespace alive unlisted."""
    import signal
    import time

    script = (f"import sys, time\nfrom halo.rpi.testbed import LossyTestbed\n"
              f"with LossyTestbed(1, prefix={PREFIX!r}) as bed:\n"
              f"    child = bed.popen('agent-1', ['sleep', '60'])\n"
              f"    print(child.pid, flush=True)\n"
              f"    time.sleep(60)\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(process.stdout.readline())
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    time.sleep(0.2)
    assert PREFIX not in namespaces() and not os.path.exists(f"/proc/{child}")


def test_sigterm_while_the_bed_is_built_leaves_nothing_behind():
    """The SIGTERM handler came after the build: a SIGTERM while building left the namespaces, bridge and veths."""
    import signal

    script = (f"import os, signal\nfrom halo.rpi.testbed import LossyTestbed\n"
              f"build = LossyTestbed._build\n"
              f"def interrupted(self):\n"
              f"    build(self)\n"
              f"    os.kill(os.getpid(), signal.SIGTERM)  # (delivered before the build returns)\n"
              f"LossyTestbed._build = interrupted\n"
              f"with LossyTestbed(2, prefix={PREFIX!r}):\n"
              f"    pass\n")
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, process.stderr
    assert PREFIX not in namespaces()


def test_names_the_kernel_or_nft_would_refuse_are_refused_first():
    for kwargs, said in (({"prefix": "1rvw"}, "a letter"), ({"prefix": "abcdefghijklm"}, "15 characters"),
                         ({"rate_mbit": -5}, "rate_mbit"), ({"links": {"agent-2": "wifi-good"}}, "agent-2")):
        with pytest.raises(ValueError, match=said):
            LossyTestbed(1, **kwargs)
