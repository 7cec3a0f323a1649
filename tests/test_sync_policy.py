"""The sync protocol without sockets: the policy table, the NACK / chase sets, epochs and the KV-input order."""

import numpy as np
import pytest

from halo.sync import POLICIES, Epoch, FramingError, Point, Status, Transport, plan_round
from halo.sync.framing import (MAX_LAYERS, attention_inputs_between, frame_broadcast, frame_partial, is_reply,
                               ranking_digest, read_broadcast, read_partial, reply_epoch)

HOLDERS, LISTENERS, CRITICAL = {1, 2, 3}, {4}, {1}


def test_tcp_sends_everything_over_the_control_connection_and_every_partial_is_critical():
    plan = plan_round(POLICIES["tcp"], HOLDERS, (), CRITICAL)
    assert plan.input_tcp == plan.partial_tcp == plan.critical == HOLDERS
    assert not (plan.input_udp or plan.partial_udp or plan.nack or plan.chase)
    assert not POLICIES["tcp"].uses_udp


def test_exact_recovers_every_partial_over_udp_until_complete():
    plan = plan_round(POLICIES["exact"], HOLDERS, (), CRITICAL)
    assert plan.input_udp == plan.partial_udp == plan.critical == plan.nack == plan.chase == HOLDERS
    assert not (plan.input_tcp or plan.partial_tcp)


def test_the_old_mode_name_says_what_to_use_instead():
    from halo.errors import ConfigError
    from halo.sync import SyncSettings

    with pytest.raises(ConfigError, match="renamed: use --sync exact"):
        SyncSettings(mode="reliable")
    assert SyncSettings().mode == "exact"


def test_lossy_recovers_only_critical_partials_and_listener_acknowledgements():
    plan = plan_round(POLICIES["lossy"], HOLDERS, LISTENERS, CRITICAL)
    assert plan.input_udp == HOLDERS | LISTENERS and not plan.input_tcp
    assert plan.partial_udp == HOLDERS | LISTENERS and not plan.partial_tcp
    assert plan.critical == plan.nack == plan.chase == {1, 4}  # 2 and 3 are dropped at the deadline, never asked for


def test_halo_recovers_every_partial_while_the_deadline_allows_but_only_critical_ones_must_arrive():
    plan = plan_round(POLICIES["halo"], HOLDERS, LISTENERS, CRITICAL)
    assert plan.critical == {1, 4}
    assert plan.nack == plan.chase == HOLDERS | LISTENERS


def test_halo_tcp_takes_critical_partials_over_tcp_and_needs_no_acknowledgement_of_a_tcp_input():
    plan = plan_round(POLICIES["halo-tcp"], HOLDERS, LISTENERS, CRITICAL)
    assert plan.input_tcp == HOLDERS | LISTENERS and not plan.input_udp
    assert plan.partial_tcp == {1} and plan.partial_udp == {2, 3}
    assert plan.critical == {1} and plan.nack == plan.chase == {2, 3}


def test_critical_holders_outside_the_round_are_ignored():
    plan = plan_round(POLICIES["halo"], {2}, (), {1, 2})
    assert plan.critical == {2}


@pytest.mark.parametrize("mode", sorted(POLICIES))
def test_every_mode_sends_each_partial_exactly_one_way(mode):
    plan = plan_round(POLICIES[mode], HOLDERS, LISTENERS, CRITICAL)
    assert not plan.partial_udp & plan.partial_tcp
    assert HOLDERS <= plan.partial_udp | plan.partial_tcp
    assert plan.nack <= plan.partial_udp and plan.chase <= plan.partial_udp
    assert POLICIES[mode].uses_udp == bool(plan.input_udp or plan.partial_udp)


def test_epochs_order_a_forward_pass_and_replies_follow_their_input():
    epochs = [Epoch(f, l, p).encode() for f in (1, 2) for l in (0, 1, 29) for p in Point]
    assert epochs == sorted(epochs)
    for value in epochs:
        assert Epoch.decode(value).encode() == value
        assert not is_reply(value) and is_reply(reply_epoch(value))
        assert Epoch.decode(reply_epoch(value)).encode() == value  # a reply names the input it answers
        assert all(reply_epoch(value) < e for e in epochs if e > value)
    with pytest.raises(ValueError):
        Epoch(1, 1 << 16, Point.MLP).encode()


def test_the_kv_inputs_an_agent_missed_come_in_order_and_only_for_its_layers():
    after = Epoch(3, 1, Point.MLP).encode()
    newest = Epoch(4, 2, Point.MLP).encode()
    expected = [Epoch(3, 2, Point.ATTENTION), Epoch(4, 0, Point.ATTENTION), Epoch(4, 2, Point.ATTENTION)]
    assert attention_inputs_between(after, newest, {2, 0}) == [e.encode() for e in expected]
    assert attention_inputs_between(newest, newest, {0, 2}) == []
    # the newest input itself is not "missed": it is handled next
    assert attention_inputs_between(after, Epoch(4, 2, Point.ATTENTION).encode(), {2}) == [expected[0].encode()]
    with pytest.raises(ValueError, match="outside"):
        attention_inputs_between(after, newest, {MAX_LAYERS})


def test_broadcast_and_partial_framing_round_trip_and_refuse_nonsense():
    x = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)
    body = frame_broadcast(x, start=5, digest=0xABCDEF, per_chunk=7)
    assert len(body) % 7 == 0
    got = read_broadcast(body, 8)
    assert (got.tokens, got.start, got.digest) == (2, 5, 0xABCDEF) and np.array_equal(got.x, x)
    for bad in ([0, 0, 0, 0], [3, 0, 0, 0], [1, -1, 0, 0]):
        with pytest.raises(FramingError):
            read_broadcast(np.concatenate([np.array(bad, np.float32), np.zeros(8, np.float32)]), 8)
    partial = read_partial(frame_partial(x, Status.KV_GAP, 1.5), 2, 8)
    assert partial.status is Status.KV_GAP and partial.compute_ms == 1.5 and np.array_equal(partial.values, x)
    assert read_partial(frame_partial(None, Status.OK, 0.0), 2, 0).values.shape == (2, 0)
    forged = frame_partial(x, Status.OK, 0.0)
    forged[2] = 9
    with pytest.raises(FramingError, match="status"):
        read_partial(forged, 2, 8)


def test_a_broadcast_carries_the_masters_ranking_and_refuses_a_forged_one():
    """HALO's MLP inputs carry the master's ranking [T, G] behind x (in the last chunk's padding where it fits); a
    ranking that is not an order of the groups, claims more values than came or disagrees with the digest is
    refused, never computed."""
    x = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)
    ranking = np.array([[2, 0, 1], [1, 2, 0]])
    body = frame_broadcast(x, 5, ranking_digest(ranking), per_chunk=13, ranking=ranking)
    assert len(body) == 26 == len(frame_broadcast(x, 5, 0, per_chunk=13))  # 4 + 16 + 6 values: x's two chunks
    got = read_broadcast(body, 8)
    assert np.array_equal(got.x, x) and np.array_equal(got.ranking, ranking) and got.ranking.dtype == np.int64
    assert read_broadcast(frame_broadcast(x, 5, 0, per_chunk=13), 8).ranking is None
    for forge, reason in ((lambda b: b.__setitem__(20, 0), "not an order"),
                          (lambda b: b.__setitem__(2, b[2] + 1), "digest"),
                          (lambda b: b.__setitem__(3, 40), "claims a ranking"),
                          (lambda b: b.__setitem__(3, 2.5), "claims a ranking"),
                          (lambda b: b.__setitem__(3, -1), "claims a ranking")):
        forged = body.copy()
        forge(forged)
        with pytest.raises(FramingError, match=reason):
            read_broadcast(forged, 8)


def test_a_broadcast_may_carry_the_next_layers_ranking_and_refuses_a_forged_one():
    """An MLP input for agents that load ahead carries the next layer's ranking behind this layer's (G + NEXT in the
    prefix): read back as given, checked to be an order of the groups (the digest covers this layer's)."""
    from halo.sync.framing import NEXT

    x = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)
    ranking, following = np.array([[2, 0, 1], [1, 2, 0]]), np.array([[0, 1, 2], [2, 1, 0]])
    body = frame_broadcast(x, 5, ranking_digest(ranking), per_chunk=13, ranking=ranking, next_ranking=following)
    assert body[3] == 3 + NEXT
    got = read_broadcast(body, 8)
    assert np.array_equal(got.ranking, ranking) and np.array_equal(got.next_ranking, following)
    assert read_broadcast(frame_broadcast(x, 5, ranking_digest(ranking), 13, ranking), 8).next_ranking is None
    with pytest.raises(ValueError, match="not shaped as"):
        frame_broadcast(x, 5, 0, 13, ranking, following[:, :2])
    for forge, reason in ((lambda b: b.__setitem__(26, 1), "not an order"),
                          (lambda b: b.__setitem__(3, 30 + NEXT), "claims two rankings of 30 groups"),
                          (lambda b: b.__setitem__(3, NEXT), "claims a ranking of 65536 groups")):
        forged = body.copy()
        forge(forged)
        with pytest.raises(FramingError, match=reason):
            read_broadcast(forged, 8)


def test_policy_transports_are_named_values():
    assert {p.input for p in POLICIES.values()} == {Transport.TCP, Transport.UDP}
