"""Generation that survives: agents killed, stopped and restarted mid-generation (halo/distributed/survive.py).

Three local agents on loopback, an even plan, the 256-token known answer of stories260K. Each test
breaks one agent at a seeded random step and checks the text and what the recoveries say.
"""

import random
import signal
import threading
import time
from contextlib import ExitStack, closing

import pytest

from halo.distributed import LocalCluster, connect
from halo.distributed.survive import ClusterLost, SurvivalSettings
from halo.generation.generate import generate
from halo.model.loader import load_tokenizer
from halo.rpi.throttle import available as throttle_available
from halo.sync import SyncSettings

STEPS = 256


def survivor(stories_weights, cluster, stack, mode="exact", rejoin_after_s=30.0, rebalance_every_s=0.0, sticky=True,
             refill=True, **kw):
    settings = SurvivalSettings(rejoin_after_s=rejoin_after_s, rebalance_every_s=rebalance_every_s, sticky=sticky,
                                input_log_mb=256.0 if refill else 0.0)
    return connect(stories_weights, stack, agents=cluster.endpoints, key=str(cluster.key_path), plan=kw.pop("plan", "even"),
                   timeout=1.0, sync=SyncSettings(mode=mode), survive=settings, context=STEPS + 8, **kw)


def run(model, weights, at_step, action, pace_s=0.0):
    """Greedy from BOS; `action()` once the model has taken `at_step` steps; pace_s: a pause per token (so
    that an agent has time to come back before the end)."""
    done = []

    def on_text(_):
        if not done and len(model.history) >= at_step:
            done.append(time.perf_counter())
            action()
        if pace_s:
            time.sleep(pace_s)

    result = generate(model, load_tokenizer(weights), "", STEPS, on_text=on_text)
    return result, done[0]


@pytest.mark.parametrize("plan", ["even-mlp", "even-mlp-only", "paired-mlp"])
def test_blocks_on_the_master_stay_there_when_an_agent_is_lost(stories_weights, known_answer, plan):
    """--plan even-mlp (-only), paired-mlp: the re-plan over the survivors is the same keyword again (the heads, and
    the LM head, never leave the master; the rest is split over who is left) and the text is the known answer."""
    step = random.Random(7).randrange(10, STEPS - 10)
    with LocalCluster(3) as cluster, ExitStack() as stack:
        model = survivor(stories_weights, cluster, stack, plan=plan)
        assert model.plan.heads_on_master and model.plan.lm_head_on_master == (plan != "even-mlp")
        assert model.planning["paired"] == (plan == "paired-mlp")

        def kill():
            cluster.processes[2].kill()
            cluster.processes[2].wait()

        result, _ = run(model, stories_weights, step, kill)
        assert result.text == known_answer
        assert len(model.recoveries) == 1 and len(model.recoveries[0].members) == 2
        assert model.plan.heads_on_master and model.plan.n == 3
        assert model.plan.lm_head_on_master == (plan != "even-mlp")
        if plan == "paired-mlp":  # paired again over the two left: each layer's MLP on the master and one of them
            mlp = model.plan.counts["mlp"]
            assert (mlp[0] > 0).all() and ((mlp[1:] > 0).sum(axis=0) == 1).all()


@pytest.mark.parametrize("mode,sticky,refill", [("exact", True, True), ("tcp", False, False)])
def test_a_killed_agent_is_planned_around_and_the_text_is_the_known_answer(stories_weights, known_answer, mode, sticky,
                                                                           refill):
    """sticky + refill (the defaults): the survivors keep their kernels, the KV caches are filled from the recorded
    inputs; full + replay: everything rebuilt and the history run again. Both give the known answer."""
    step = random.Random(16).randrange(10, STEPS - 10)
    with LocalCluster(3) as cluster, ExitStack() as stack:
        model = survivor(stories_weights, cluster, stack, mode, sticky=sticky, refill=refill)
        victim = cluster.endpoints[1]

        def kill():
            cluster.processes[1].kill()
            cluster.processes[1].wait()

        result, killed_at = run(model, stories_weights, step, kill)
        assert result.text == known_answer
        assert len(model.recoveries) == 1, [r.to_json() for r in model.recoveries]
        recovery = model.recoveries[0]
        assert recovery.lost == [victim] and victim not in recovery.members and len(recovery.members) == 2
        assert recovery.replayed_tokens >= step
        assert recovery.seconds < 2.0  # re-plan + new session + replay of the history
        assert recovery.sticky == sticky and recovery.refilled == refill
        if sticky:  # the master and both survivors kept their kernels: only the victim's quarter was built
            total = recovery.kept_groups + recovery.moved_groups
            assert recovery.moved_groups <= 0.3 * total, recovery.to_json()
        assert model.in_plan() == recovery.members and victim in model.survival_report()["absent"]
        # the per-token breakdown counts the tokens before the re-plan too (not the replay)
        assert model.timings.forwards >= len(result.token_ids) - 1
        rounds = model.sync_report()["breakdown"]["rounds_per_token"]  # (+ what a pass cut short had done)
        assert 2 * stories_weights.config.n_layers + 1 <= rounds < 2 * stories_weights.config.n_layers + 1.1


def test_a_stopped_agent_is_left_out_then_taken_back_when_it_answers_again(stories_weights, known_answer):
    with LocalCluster(3) as cluster, ExitStack() as stack:
        model = survivor(stories_weights, cluster, stack, "exact", rejoin_after_s=0.5)
        victim = cluster.endpoints[2]
        process = cluster.processes[2]

        def stop_for_five_seconds():
            process.send_signal(signal.SIGSTOP)
            threading.Timer(5.0, process.send_signal, (signal.SIGCONT,)).start()

        result, _ = run(model, stories_weights, 30, stop_for_five_seconds, pace_s=0.04)
        assert result.text == known_answer
        causes = [(r.lost, r.joined) for r in model.recoveries]
        assert causes[0] == ([victim], []), causes
        assert ([], [victim]) in causes, causes  # back after SIGCONT, through a re-plan
        assert victim in model.in_plan()


def test_a_restarted_agent_is_used_again_after_the_next_replan(stories_weights, known_answer):
    with LocalCluster(3) as cluster, ExitStack() as stack:
        model = survivor(stories_weights, cluster, stack, "tcp", rejoin_after_s=0.2)
        victim = cluster.endpoints[0]

        def kill_and_restart():  # back before the master notices: it finds an agent without a session
            cluster.processes[0].kill()
            cluster.processes[0].wait()
            cluster.restart(0)  # in this thread: the agent would die with a thread that ends (PR_SET_PDEATHSIG)

        result, _ = run(model, stories_weights, 20, kill_and_restart, pace_s=0.03)
        assert result.text == known_answer
        joined = [r for r in model.recoveries if r.joined]
        assert joined and joined[0].joined == [victim] and victim in model.in_plan()
        # sticky: it takes back its share of the first plan; only the restarted agent builds (a quarter)
        assert joined[0].sticky and joined[0].moved_groups <= 0.3 * (joined[0].kept_groups + joined[0].moved_groups)
        assert cluster.processes[0].poll() is None


def test_devices_left_too_small_for_the_model_are_named(stories_weights, tmp_path):
    """A declared cluster: the master and each agent hold about a third of the model; one agent lost -> no plan."""
    with LocalCluster(3) as cluster, ExitStack() as stack:
        devices = "".join(f'[[device]]\nname = "agent-{i}"\naddress = "{e}"\nmemory_mb = 0.45\ncompute_gflops = 1\n'
                          for i, e in enumerate(cluster.endpoints, start=1))
        path = tmp_path / "cluster.toml"
        path.write_text('[cluster]\nweights = "fp32"\ncontext = 264\n[[device]]\nname = "master"\nmaster = true\n'
                        f'memory_mb = 0.45\ncompute_gflops = 1\n{devices}')
        model = connect(stories_weights, stack, cluster=str(path), key=str(cluster.key_path), timeout=1.0,
                        sync=SyncSettings(mode="tcp"), context=STEPS + 8)
        assert len(model.in_plan()) == 3

        def kill_two():
            for p in cluster.processes[:2]:
                p.kill()
                p.wait()

        with pytest.raises(ClusterLost, match=r"cannot hold the model: .*MB"):
            run(model, stories_weights, 12, kill_two)


@pytest.mark.skipif(not throttle_available()[0], reason=f"the straggler needs a cgroup: {throttle_available()[1]}")
def test_a_persistently_slow_agent_loses_its_work_to_the_others(stories_weights, known_answer):
    """One agent held to 3 % of a core: once every device has a window of estimates, the re-plan from them
    gives the straggler less (or nothing), and the text stays the known answer."""
    from halo.rpi.throttle import CpuThrottle

    with LocalCluster(3) as cluster, ExitStack() as stack:
        model = survivor(stories_weights, cluster, stack, "tcp", rebalance_every_s=0.5)
        slow = cluster.endpoints[1]
        before = groups_of(model, slow)
        with CpuThrottle(cluster.processes[1].pid, quota=0.03, period_s=None):
            result = generate(model, load_tokenizer(stories_weights), "", STEPS)
        assert result.text == known_answer
        rebalanced = [r for r in model.recoveries if r.kind == "rebalanced"]
        assert rebalanced, [r.to_json() for r in model.recoveries]
        assert groups_of(model, slow) < before, (before, groups_of(model, slow), rebalanced[0].cause)


def test_a_rebalance_after_a_loss_plans_over_the_agents_left(stories_weights):
    """The straggler re-plan planned over every device the first plan had, a lost agent too: with an even plan's
    devices (no addresses) a KeyError ended the generation; with addresses it planned the dead agent back in. It plans
    over the participants, and the plan it returns still knows the lost agent, which a later join may bring back."""
    from types import SimpleNamespace

    from halo.compute.neuron_groups import GroupLayout
    from halo.distributed.connect import Replanner
    from halo.scheduler.profiles import Cluster, DeviceProfile, model_profile
    from halo.scheduler.tp_plan import build_plan

    cluster = Cluster(tuple(DeviceProfile(name, 1e9, 1e9, is_master=name == "master")
                            for name in ("master", "a", "lost")), 264, "fp32")
    plan = build_plan(cluster, model_profile(stories_weights.config, "fp32", "s"), "minmax", [0, 1], prune=False)
    model = SimpleNamespace(plan=plan, agents={1: SimpleNamespace(endpoint="tcp://127.0.0.1:7001")},
                            estimates=SimpleNamespace(updated_cluster=lambda plan, mode, sync: plan.cluster))
    planner = Replanner(stories_weights, GroupLayout.for_model(stories_weights.config), plan, False, False,
                        SyncSettings(), 264)
    new, endpoints, _, _ = planner.observed(model, {1: "tcp://127.0.0.1:7001", 2: "tcp://127.0.0.1:7002"})
    assert endpoints == ["tcp://127.0.0.1:7001"] and len(new.devices) == 2
    planner.adopt(new)  # the rebalanced plan in use: the lost agent can still come back into a later plan
    _, back = planner.survivors(["tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"])
    assert back == ["tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"]


def groups_of(model, endpoint: str) -> int:
    rows = [r for r in model.report() if r["endpoint"] == endpoint]
    return rows[0]["heads"] + rows[0]["mlp_groups"] + rows[0]["vocab_groups"] if rows else 0


def test_stopping_local_agents_does_not_wait_out_a_stopped_one():
    """A SIGSTOPped agent takes no SIGTERM until continued: the master waited the whole 5 s grace before SIGKILL,
    for an agent the survival layer had already planned around."""
    import subprocess

    from halo.distributed import stop_processes

    import sys

    drains = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); print(flush=True); time.sleep(60)"
    stopped = subprocess.Popen([sys.executable, "-c", drains], stdout=subprocess.PIPE)  # handles SIGTERM, as agents do
    stopped.stdout.readline()  # its handler is in place
    stopped.send_signal(signal.SIGSTOP)
    t = time.monotonic()
    stop_processes([stopped], grace_s=5.0)
    assert time.monotonic() - t < 2.0 and stopped.returncode == 0  # it drained, not killed after the grace


def test_generate_json_says_what_the_survival_layer_did(capsys):
    """--json in tensor-parallel mode left out the recoveries (pipeline mode's JSON has them): a script could not
    tell that an agent was lost and the per-agent figures cover only the survivors."""
    import json

    from halo.cli.master import main

    assert main(["generate", "--local-agents", "1", "--plan", "even", "--max-new-tokens", "2", "--json"]) == 0
    survival = json.loads(capsys.readouterr().out)["survival"]
    assert survival["recoveries"] == [] and len(survival["in_plan"]) == 1


def test_the_loss_report_covers_the_tokens_before_a_replan(stories_weights):
    """Each re-plan's master started an empty loss ledger, so --json's sync.loss covered only the tokens after the
    last re-plan (the losses before it, often the heaviest, were gone: 'blocks 52' where a run without one said 120)."""
    with LocalCluster(3) as cluster, ExitStack() as stack:
        model = survivor(stories_weights, cluster, stack, "lossy")
        seen = []  # partials counted before the kill, and at the first token after the re-plan

        def on_text(_):
            if len(seen) == 0 and len(model.history) >= 40:
                seen.append(model.sync_report()["loss"]["partials"])
                cluster.processes[1].kill()
                cluster.processes[1].wait()
            elif len(seen) == 1 and model.recoveries:
                seen.append(model.sync_report()["loss"]["partials"])

        generate(model, load_tokenizer(stories_weights), "", 60, on_text=on_text)
        assert len(model.recoveries) == 1 and len(seen) == 2
    assert seen[0] > 0 and seen[1] >= seen[0]  # (it fell back to the few partials since the re-plan)


def test_each_failure_after_a_return_doubles_the_quarantine():
    """A returning device's failure count was dropped: one that answered status and then refused every hello
    (another model) came back at the same pace all generation long."""
    from halo.runtime.replanning import Membership

    class Answered:
        def poll(self, timeout_ms):
            return True

        def close(self, linger=0):
            pass

    membership = Membership(SurvivalSettings(rejoin_after_s=5.0), lambda name: Answered())
    waits = []
    for _ in range(3):
        membership.fail("pi")
        waits.append(round(membership.absent["pi"].not_before - time.monotonic()))
        membership.absent["pi"].not_before = 0.0  # its quarantine is over: asked, it answers, it returns
        membership.returning()
        assert membership.returning() == ["pi"] and "pi" not in membership.absent
    assert waits == [5, 10, 20]


def test_a_master_whose_agent_another_master_took_says_so_and_goes_on(stories_weights):
    """Two masters on one agent took it from each other, each told only "not in session" and taking that for an
    agent failure. The one taken over now says who took it, goes on without it, and asks it back only after a
    quarantine that doubles each time (so two masters settle instead of trading it every few seconds)."""
    from halo.distributed import cluster_model

    with LocalCluster(1) as cluster, ExitStack() as stack:
        first = survivor(stories_weights, cluster, stack, "tcp")
        first.forward([1, 2])
        second = stack.enter_context(closing(cluster_model(stories_weights, cluster.endpoints, cluster.key,
                                                           context=64, sync=SyncSettings(mode="tcp"))))
        first.forward([3], 2)
        assert first.in_plan() == [] and "took this agent over" in first.recoveries[0].cause
        assert first.survival_report()["absent"][cluster.endpoints[0]]["failures"] == 1
        second.forward([1, 2])  # still its own
