"""Pipeline mode survives the way tensor-parallel mode does (halo/runtime/replanning.py, shared): a stage worker that
comes back is planned over again, and a persistently slow one loses its layers; the text stays the known
answer (loss alone: tests/test_pipeline.py).

Profiles are given, not measured, so that the plan is known: every worker holds 60 % of the model (the plan
needs two of the three), and where a test needs it one worker is ten times faster than the others."""

import os
import signal
import threading
import time
from contextlib import contextmanager

import zmq

from halo.generation.generate import generate
from halo.model.loader import load_tokenizer, model_fingerprint
from halo.pipeline.connect import local_stage_workers
from halo.pipeline.coordinator import PipelineModel
from halo.pipeline.links import NativeStage
from halo.pipeline.profile import WorkerProfile
from halo.pipeline.replan import model_costs
from halo.runtime.replanning import SurvivalSettings
from halo.scheduler.pipeline import model_units

CONTEXT = 264
STEPS = 256


def cluster(workers, weights, fast: int | None = None, **settings):
    context = zmq.Context()
    sha = model_fingerprint(weights.source)
    links = [NativeStage(context, e, workers.key, False, 5.0, sha) for e in workers.endpoints]
    memory = 0.6 * model_units(model_costs(weights.config, "fp32"), CONTEXT).memory.sum()
    profiles = [WorkerProfile(link.name, "numpy-cpu", memory, 1e-4 if i == fast else 1e-3) for i, link in enumerate(links)]
    model = PipelineModel(weights, links, None, CONTEXT, profiles=profiles, survive=SurvivalSettings(**settings))
    return context, model


def units_of(model, worker: int) -> int:
    return sum(s.stop - s.start for s in model.stages if s.worker == worker)


def test_a_worker_that_comes_back_is_planned_over_again(stories_weights, known_answer):
    with local_stage_workers(3) as workers:
        context, model = cluster(workers, stories_weights, fast=1, rejoin_after_s=0.2, rebalance_every_s=0)
        assert units_of(model, 1) > 0  # the fast worker has work
        events = []

        def on_text(_):
            if not events and model.step >= 40:
                workers.processes[1].kill()
                workers.processes[1].wait()
                events.append("killed")
            elif events == ["killed"] and model.recoveries:
                assert units_of(model, 1) == 0
                workers.restart(1)  # a device that rebooted, at its old address
                events.append("restarted")
            elif events == ["restarted"]:
                time.sleep(0.01)  # give the status probe a few passes to be answered

        try:
            result = generate(model, load_tokenizer(stories_weights), "", STEPS, on_text=on_text)
            report = model.report()
        finally:
            model.close()
            context.destroy(linger=0)
    assert events == ["killed", "restarted"] and result.text == known_answer
    kinds = [r["kind"] for r in report["recoveries"]]
    assert kinds == ["lost", "joined"], report["recoveries"]
    lost, joined = report["recoveries"]
    assert lost["lost"] == joined["joined"] == [model.workers[1].name]
    assert joined["replayed_tokens"] > 40
    assert any(name == model.workers[1].name for name, _, _ in joined["members"])  # back in the plan
    assert units_of(model, 1) > 0


@contextmanager
def mostly_stopped(pid: int, run_s: float = 0.0002, stop_s: float = 0.002):
    """The process runs in bursts of ~0.2 ms, ~10 % of the wall time (SIGSTOP / SIGCONT): shorter than one of its
    decode calls, so every call is stopped midway several times and is slow, however fast the machine. (A cgroup
    CPU quota cannot do that to a tiny model: its quota is at least 1 ms per period, and stories260K's stage calls
    take ~0.5 ms on a fast core, so most calls fit between throttles and the median decode time stays fast.)"""
    done = threading.Event()

    def cycle():
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        os.kill(pid, signal.SIGCONT)


def test_a_persistently_slow_worker_loses_its_layers(stories_weights, known_answer):
    """A planned worker that runs 10 % of the time: once every stage has a window of decode times, its profile is
    rescaled and the DP moves its layers to the idle worker; the text stays the known answer."""
    with local_stage_workers(3) as workers:
        context, model = cluster(workers, stories_weights, rebalance_every_s=0.3)
        slow = model.stages[0].worker
        before = units_of(model, slow)
        try:
            with mostly_stopped(workers.processes[slow].pid):
                result = generate(model, load_tokenizer(stories_weights), "", STEPS)
            report = model.report()
        finally:
            model.close()
            context.destroy(linger=0)
    assert result.text == known_answer
    rebalanced = [r for r in report["recoveries"] if r["kind"] == "rebalanced"]
    assert rebalanced, report["recoveries"]
    assert rebalanced[0]["lost"] == [model.workers[slow].name] and units_of(model, slow) < before


def test_a_late_answer_to_a_request_from_before_a_failure_is_not_taken_for_the_current_one():
    """A request queued on a link when its worker died reaches the restarted worker, whose answer (an error) comes
    first: the link skips answers whose echoed call number is not the current request's."""
    from halo.transport.reliable import Message, decode, encode

    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    link = NativeStage(context, f"tcp://127.0.0.1:{port}", None, True, 5.0, "0" * 64)
    try:
        link.calls = 6  # six requests went out before the failure; the sixth was never answered
        link.alive = False
        link.reconnect()  # the worker is back; numbers go on (a restarted count could meet a late answer's)
        import threading

        def answer():
            identity, *frames = server.recv_multipart()
            request = decode(frames)
            late = Message("error", {"reason": "'forward' before hello: no session", "call": 6})
            server.send_multipart([identity, *encode(late)])
            server.send_multipart([identity, *encode(Message("pong", {"call": request.fields["call"]}))])

        thread = threading.Thread(target=answer)
        thread.start()
        reply = link._call("ping", {}, what="a ping")
        thread.join()
        assert reply.kind == "pong" and reply.fields["call"] == 7
    finally:
        link.close()
        server.close(linger=0)
        context.destroy(linger=0)
