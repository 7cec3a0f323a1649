"""Emulated radio links in the test bed (rpi/links.py, rpi/linkemu.c): the configured one-way delay, jitter, loss
and loss-burst length are what the bed's own probes measure, within 10 %; what the forwarder adds at zero delay."""

import pytest

from halo.rpi import testbed
from halo.rpi.links import PROFILES, LinkProfile, measure, profile

ok, why = testbed.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"the namespace test bed cannot run here: {why}")

ZERO = LinkProfile("zero", 0.0)


@pytest.fixture(scope="module")
def bed():
    with testbed.LossyTestbed(n_agents=3, prefix="lk", links={"agent-1": "wifi-busy", "agent-2": ZERO}) as bed:
        yield bed


def test_delay_and_jitter_are_the_profiles(bed):
    """Probes 7 ms apart (more than the jitter's 6 ms span: one never waits behind the one ahead, which a link
    that keeps order would make it): the median one-way delay is 5 ms and the 10th-90th percentile spread that of
    uniform +- 3 ms (4.8 ms). The forwarders run at real-time priority and the probes read the kernel's arrival
    times: at normal priority, in CI's busy run, this link measured 5.5 ms."""
    if not _realtime_allowed():
        pytest.skip("no real-time priority here (CAP_SYS_NICE): the forwarders' late wake-ups would be measured as "
                    "the link's delay")
    assert all(forwarder.realtime for forwarder in bed.forwarders.values())
    link = PROFILES["wifi-busy"]
    both = [measure(bed, "master", "agent-1", count=500, interval_us=7000),
            measure(bed, "agent-1", "master", count=500, interval_us=7000, port=7301)]
    for one_way in both:
        delay = one_way["delay_ms"]
        assert delay["p50"] == pytest.approx(link.delay_ms, rel=0.10), one_way
        assert delay["p90"] - delay["p10"] == pytest.approx(0.8 * 2 * link.jitter_ms, rel=0.10), one_way


def _realtime_allowed() -> bool:
    """Whether a process may take real-time priority here (chrt: util-linux, as nsenter the bed needs)."""
    import subprocess

    try:
        return subprocess.run(["chrt", "-f", "10", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def test_loss_comes_in_bursts_of_the_profiles_length(bed):
    link = PROFILES["wifi-busy"]
    one_way = measure(bed, "master", "agent-1", count=100_000, interval_us=100, port=7302)
    assert one_way["loss"] == pytest.approx(link.loss, rel=0.10), one_way
    assert one_way["mean_burst"] == pytest.approx(link.burst, rel=0.10), one_way


def test_what_the_forwarder_adds_at_zero_delay(bed):
    """A link emulated at zero delay against a plain veth, side by side: the forwarder's own cost (~10-20 us here)."""
    emulated = measure(bed, "master", "agent-2", count=2000, interval_us=1000, port=7303)["delay_ms"]
    plain = measure(bed, "master", "agent-3", count=2000, interval_us=1000, port=7304)["delay_ms"]
    assert emulated["p50"] - plain["p50"] < 0.2, (emulated, plain)
    assert bed.drop_counters() == {}  # no nftables loss here: what the links lose is their own
    forwarded = bed.forwarders["agent-2"].stop()  # the probes did cross the forwarder (the last test on agent-2)
    assert forwarded["a2b"]["lost"] == 0 and forwarded["b2a"]["sent"] >= 2000, forwarded


def test_profiles_are_checked():
    assert profile("wifi-good").spec() == "2000,1000,0.01,3,0"
    with pytest.raises(ValueError, match="unknown link profile 'wifi-great'"):
        profile("wifi-great")
    with pytest.raises(ValueError, match="jitter <= delay"):
        LinkProfile("odd", 1.0, jitter_ms=2.0)


@pytest.mark.parametrize("name", ["wifi-good", "wifi-busy", "wifi-bad"])
def test_a_radio_links_lossless_twin_is_the_same_link_without_its_losses(name):
    link, twin = PROFILES[name], profile(f"{name}-lossless")
    assert (twin.delay_ms, twin.jitter_ms, twin.rate_mbit) == (link.delay_ms, link.jitter_ms, link.rate_mbit)
    assert twin.loss == 0 and link.loss > 0 and twin.spec().split(",")[2] == "0"


def test_a_burst_is_a_time_on_the_air_so_sparse_traffic_sees_short_bursts(bed):
    """Probes 1 ms apart (10 of the chain's 100 us steps): the loss rate is the profile's, but bursts are ~1 frame,
    not the ~5 of back-to-back frames. Stepped per frame alone, a link carrying a datagram every 40 ms stayed in one
    burst for seconds and took every retry of a round."""
    link = PROFILES["wifi-busy"]
    one_way = measure(bed, "master", "agent-1", count=4000, interval_us=1000, port=7304)
    assert one_way["loss"] == pytest.approx(link.loss, rel=0.35), one_way
    assert one_way["mean_burst"] < 1.6, one_way


def test_a_loss_no_chain_can_give_with_that_burst_is_refused():
    """A mean loss of 60 % in bursts of 1 frame needs P(good -> bad) = 1.5: the forwarder says what burst it needs."""
    import subprocess

    from halo.rpi.links import linkemu_binary

    done = subprocess.run([str(linkemu_binary()), "lo", "lo", "0,0,0.6,1,0", "0,0,0,1,0"], capture_output=True,
                          text=True, timeout=10)
    assert done.returncode == 2 and "needs bursts of at least 1.5 frames" in done.stderr, done.stderr


@pytest.fixture
def veth_ends():
    """Two interfaces for a forwarder of its own (each a veth with its peer up), removed afterwards."""
    names = ("lkgd", "lkgw")
    for name in names:
        testbed._run("ip", "link", "add", name, "type", "veth", "peer", "name", name + "p")
        testbed._run("ip", "link", "set", name, "up")
        testbed._run("ip", "link", "set", name + "p", "up")
    yield names
    for name in names:
        testbed._run("ip", "link", "del", name, check=False)


def test_a_forwarder_whose_interface_is_gone_ends(veth_ends):
    """One left behind by a crashed run used to spin a core on its socket's error (at real-time priority, all of it)."""
    from halo.rpi.links import Forwarder

    forwarder = Forwarder(*veth_ends, ZERO)
    testbed._run("ip", "link", "del", veth_ends[0])
    assert forwarder.process.wait(timeout=5) == 0
    assert "interface lkgd is gone" in forwarder.process.stderr.read()


def test_a_forwarder_ends_with_the_process_that_started_it(veth_ends):
    """A bed's owner killed outright (no teardown) leaves no forwarder running."""
    import signal
    import subprocess
    import sys
    import time

    owner = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom halo.rpi.links import Forwarder, LinkProfile\n"
                              f"f = Forwarder({veth_ends[0]!r}, {veth_ends[1]!r}, LinkProfile('zero', 0.0))\n"
                              "print(f.process.pid, flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    pid = int(owner.stdout.readline())
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.05)
    assert not _running(pid)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a forwarder whose owner died is reaped by init, not at once)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_forwarder_outlives_its_interface_going_down_and_up(veth_ends):
    """Down is not gone: the socket's error (ENETDOWN) is read and the forwarder goes on (it used to end there)."""
    import time

    from halo.rpi.links import Forwarder

    forwarder = Forwarder(*veth_ends, ZERO)
    try:
        testbed._run("ip", "link", "set", veth_ends[0], "down")
        time.sleep(0.3)
        testbed._run("ip", "link", "set", veth_ends[0], "up")
        time.sleep(0.3)
        assert forwarder.process.poll() is None, forwarder.process.stderr.read()
    finally:
        forwarder.stop()
