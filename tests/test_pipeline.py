"""Pipeline mode over native stage workers: exactness for 1-4 stages, planning from measured profiles,
recovery after a killed worker, and refusal of bad input."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from halo.compute.transformer import Transformer
from halo.errors import ConfigError
from halo.generation.generate import generate
from halo.model.loader import load_tokenizer, load_weights, model_fingerprint
from halo.pipeline.connect import local_stage_workers
from halo.pipeline.coordinator import PipelineError, PipelineModel
from halo.pipeline.links import LocalStage, NativeStage
from halo.pipeline.replan import Stage, even_stages, plan_stages, validate_stages
from halo.pipeline.stage import HeadRequest, StageEngine, top_k
from halo.transport.reliable import Message, decode, encode, generate_key

CONTEXT = 512


def native_links(workers, weights, timeout=5.0):
    context = zmq.Context()
    sha = model_fingerprint(weights.source)
    return context, [NativeStage(context, e, workers.key, False, timeout, sha) for e in workers.endpoints]


def test_stage_engines_chained_equal_the_reference_bit_for_bit(stories_weights):
    reference = Transformer(stories_weights, max_seq_len=64)
    tokens = np.array([1, 403, 407, 261, 378], dtype=np.int64)
    expected = reference.forward(tokens)
    expected_next = reference.forward([7])
    for stages in ([(0, 7)], [(0, 2), (2, 7)], [(0, 1), (1, 4), (4, 6), (6, 7)]):
        engines = [StageEngine(stories_weights, a, b, 64) for a, b in stages]

        def run(x, pos, head=HeadRequest(0)):
            for e in engines:
                x = e.forward(x, pos, head)[0]
            return x

        assert np.array_equal(run(tokens, 0)[-1], expected)
        assert np.array_equal(run(np.array([7]), 5)[-1], expected_next)


def test_the_torch_engine_gives_the_greedy_tokens_of_the_numpy_engine(stories_weights, known_answer):
    """What a CUDA worker runs, here on torch's CPU device (no GPU needed)."""
    pytest.importorskip("torch")
    links = [LocalStage(stories_weights, "gpu-like", device="torch-cpu"), LocalStage(stories_weights, "cpu")]
    model = PipelineModel(stories_weights, links, [Stage(0, 0, 4), Stage(1, 4, 7)], CONTEXT)
    assert model.ready[0]["engine"] == "torch-cpu"
    assert generate(model, load_tokenizer(stories_weights), "", 256).text == known_answer


def test_a_gpu_stage_in_fp16_gives_the_known_answer_with_half_the_bytes(stories_weights, known_answer):
    """--weights native (or int8) on a torch stage: fp16 matrices, as a CUDA worker holds them (here on torch's CPU)."""
    pytest.importorskip("torch")
    from halo.pipeline.torch_stage import TorchStageEngine

    links = [LocalStage(stories_weights, "gpu-like", device="torch-cpu"), LocalStage(stories_weights, "cpu")]
    model = PipelineModel(stories_weights, links, [Stage(0, 0, 4), Stage(1, 4, 7)], CONTEXT, "native")
    assert model.ready[0]["engine"] == "torch-cpu-fp16"
    assert generate(model, load_tokenizer(stories_weights), "", 256).text == known_answer
    fp32 = TorchStageEngine(stories_weights, 1, 5, 64, "cpu", "fp32")
    fp16 = TorchStageEngine(stories_weights, 1, 5, 64, "cpu", "int8")
    norms = sum(fp32.weights[l][n].nbytes for l in fp32.layers for n in ("attn_norm", "mlp_norm"))
    assert fp16.weight_nbytes - norms == (fp32.weight_nbytes - norms) // 2


def test_a_ggufs_4bit_blocks_load_into_the_fp16_engine_and_agree_with_the_cpu_stage(tmp_path):
    """A GGUF's matrices are QuantizedMatrix objects: dequantized once, whole (numpy took them row by row)."""
    pytest.importorskip("torch")
    from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf
    from halo.pipeline.torch_stage import TorchStageEngine

    small = {**TINYLLAMA_1_1B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 512}
    weights = load_weights(write_random_gguf(tmp_path / "small-Q4_0.gguf", small, "Q4_0"))
    gpu_like = TorchStageEngine(weights, 0, 4, 64, "cpu", "native")
    cpu = StageEngine(weights, 0, 4, 64, "native")
    tokens = np.array([1, 5, 9, 300])
    a, b = (e.forward(tokens, 0, HeadRequest(0))[0] for e in (gpu_like, cpu))
    assert gpu_like.engine == "torch-cpu-fp16" and np.abs(a - b).max() < 1e-2 * np.abs(b).max()


def test_the_graph_ready_decode_step_equals_the_eager_pass(stories_weights):
    """The static decode step (the whole cache, later positions masked, the position a device tensor: what a CUDA
    graph captures) against one eager pass over the same positions."""
    pytest.importorskip("torch")
    from halo.pipeline.torch_stage import TorchStageEngine

    tokens = np.array([1, 403, 407, 261, 438, 300, 5, 90])
    stepwise = TorchStageEngine(stories_weights, 0, 7, 64, "cpu", "fp32")
    steps = np.concatenate([stepwise.forward(tokens[i:i + 1], i, HeadRequest(0))[0] for i in range(len(tokens))])
    eager = TorchStageEngine(stories_weights, 0, 7, 64, "cpu", "fp32").forward(tokens, 0, HeadRequest(0, True))[0]
    assert steps.shape == eager.shape == (len(tokens), stories_weights.config.vocab_size)
    assert np.abs(steps - eager).max() < 1e-4
    middle = TorchStageEngine(stories_weights, 2, 5, 64, "cpu", "fp32")  # a stage that takes and gives residuals
    x = np.random.default_rng(0).standard_normal((3, stories_weights.config.dim)).astype(np.float32)
    rows = np.concatenate([middle.forward(x[i:i + 1], i)[0] for i in range(3)])
    middle.reset()
    assert np.abs(rows - middle.forward(x, 0)[0]).max() < 1e-4


@pytest.mark.skipif(not __import__("halo.compute.backends", fromlist=["x"]).cuda_available(),
                    reason="no CUDA device here: the graph capture runs only on a GPU (the device tool's machine)")
def test_the_cuda_graph_replays_the_eager_step(stories_weights):
    from halo.pipeline.torch_stage import TorchStageEngine

    tokens = np.array([1, 403, 407, 261])
    graphed, plain = (TorchStageEngine(stories_weights, 0, 7, 64, "cuda", "native", graphs=g) for g in (True, False))
    for i, t in enumerate(tokens):
        a, b = (e.forward(np.array([t]), i, HeadRequest(0))[0] for e in (graphed, plain))
        assert np.abs(a - b).max() < 1e-5
    assert graphed._graph is not None


def test_mixed_plans_price_each_engine_by_the_bytes_it_holds(stories_weights):
    """A GPU stage in fp16 next to CPU stages on 4-bit blocks: the GPU, far faster, takes every layer it can hold,
    counted in fp16 (a plan that counted Q4_0 bytes would hand it ~3.5x the layers it has memory for)."""
    from halo.pipeline.profile import WorkerProfile
    from halo.pipeline.replan import model_costs
    from halo.scheduler.pipeline import model_units

    c = stories_weights.config
    units = model_units(model_costs(c, "Q4_0"), 64).memory
    gpu_memory = 0.5 * units.sum() * 2.0 / (18 / 32)  # half the model, at fp16's 2 bytes a weight
    profiles = [WorkerProfile("gpu", "torch-cuda-fp16", gpu_memory, 1e-5, weight_format="fp16"),
                WorkerProfile("pi", "numpy-cpu", 10 * units.sum(), 1e-3),
                WorkerProfile("tab", "onnx-webgpu", 10 * units.sum(), 5e-3, weight_format="fp32")]
    model = model_costs(c, "Q4_0")
    devices = [p.to_device(model, "Q4_0") for p in profiles]
    assert devices[0].memory_bytes == pytest.approx(0.5 * units.sum())
    stages, plan = plan_stages(devices, c, "Q4_0", 64)
    assert plan.complete
    gpu_units = sum(s.stop - s.start for s in stages if s.worker == 0)
    held = units[[u for s in stages if s.worker == 0 for u in range(s.start, s.stop)]].sum()
    assert held <= 0.5 * units.sum() and gpu_units >= 2
    assert all(s.worker != 2 for s in stages)  # the slow tab is not needed: the Pi holds the rest faster


def test_top_k_is_argmax_first_and_breaks_ties_by_id():
    logits = np.array([0.5, 2.0, 2.0, -1.0, 1.0], dtype=np.float32)
    ids, values = top_k(logits, 3)
    assert ids.tolist() == [1, 2, 4] and values.tolist() == [2.0, 2.0, 1.0]
    assert top_k(logits, 1)[0][0] == np.argmax(logits)


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_known_answer_through_native_stages(stories_weights, known_answer, n_stages):
    with local_stage_workers(n_stages) as workers:
        context, links = native_links(workers, stories_weights)
        model = PipelineModel(stories_weights, links, even_stages(stories_weights.config, n_stages), CONTEXT)
        try:
            result = generate(model, load_tokenizer(stories_weights), "", 256)
            report = model.report()
        finally:
            model.close()
            context.destroy(linger=0)
    assert result.text == known_answer
    assert [(s["start"], s["stop"]) for s in report["stages"]] == [(s.start, s.stop) for s in even_stages(
        stories_weights.config, n_stages)]
    # greedy: the head returns one id and its logit, never the 512-wide logits
    assert report["bytes_per_forward"] < 2000 * n_stages


def test_random_hf_model_greedy_tokens_through_1_to_4_stages(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import make_checkpoint

    make_checkpoint(tmp_path, seed=5, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=160)
    weights = load_weights(tmp_path)
    tokenizer = load_tokenizer(weights)
    expected = generate(Transformer(weights, max_seq_len=128), tokenizer, "Once upon a time", 24).token_ids
    with local_stage_workers(4, model_path=str(tmp_path)) as workers:
        context, links = native_links(workers, weights)
        try:
            for n in (1, 2, 3, 4):
                model = PipelineModel(weights, links[:n], even_stages(weights.config, n), 128)
                assert generate(model, tokenizer, "Once upon a time", 24).token_ids == expected, n
        finally:
            for link in links:
                link.close()
            context.destroy(linger=0)


def test_full_logits_and_all_positions_equal_the_reference(stories_weights):
    reference = Transformer(stories_weights, max_seq_len=64)
    links = [LocalStage(stories_weights, "a"), LocalStage(stories_weights, "b")]
    model = PipelineModel(stories_weights, links, [Stage(0, 0, 3), Stage(1, 3, 7)], 64, head_top_k=0)
    tokens = [1, 403, 407]
    assert np.array_equal(model.forward(tokens, start_pos=0, all_logits=True),
                          reference.forward(tokens, start_pos=0, all_logits=True))
    assert np.array_equal(model.forward([9]), reference.forward([9]))
    # rewinding (lm-eval scores from position 0 again) overwrites the cache
    assert np.array_equal(model.forward([1, 5], start_pos=0), reference.forward([1, 5], start_pos=0))


def test_the_planner_uses_measured_profiles_and_splits_only_when_memory_forces_it(stories_weights):
    links = [LocalStage(stories_weights, "a"), LocalStage(stories_weights, "b")]
    model = PipelineModel(stories_weights, links, None, 64)
    assert len(model.stages) == 1  # stages run one after another: one worker that holds it all is fastest
    assert model.predicted_ms() > 0
    devices = model.devices()
    from halo.pipeline.replan import model_costs
    from halo.scheduler.pipeline import model_units

    needed = model_units(model_costs(stories_weights.config, "fp32"), 64).memory.sum()
    small = [type(d)(d.name, 0.6 * needed, d.compute_flops) for d in devices]
    stages, plan = plan_stages(small, stories_weights.config, "fp32", 64)
    assert len(stages) == 2 and plan.complete
    with pytest.raises(ConfigError, match="hold only units"):
        plan_stages(small[:1], stories_weights.config, "fp32", 64)


def test_plans_that_do_not_fit_the_model_are_refused(stories_weights):
    c, names = stories_weights.config, ["a", "b"]
    validate_stages([Stage(0, 0, 4), Stage(1, 4, 7)], c, names)
    for bad, message in [([Stage(0, 0, 4)], "covers units 0..3 of 7"),
                         ([Stage(0, 0, 4), Stage(1, 3, 7)], "gap or overlap"),
                         ([Stage(0, 0, 4), Stage(0, 4, 7)], "appears twice"),
                         ([Stage(0, 0, 4), Stage(2, 4, 7)], "not among the 2 workers"),
                         ([Stage(0, 0, 4), Stage(1, 4, 9)], "beyond")]:
        with pytest.raises(ConfigError, match=message):
            validate_stages(bad, c, names)


def test_a_killed_worker_is_replaced_by_re_planning_and_the_text_is_unchanged(stories_weights, known_answer):
    tokenizer = load_tokenizer(stories_weights)
    with local_stage_workers(4) as workers:
        context, links = native_links(workers, stories_weights, timeout=10.0)
        model = PipelineModel(stories_weights, links, [Stage(0, 0, 2), Stage(1, 2, 4), Stage(2, 4, 7)], CONTEXT)
        killed = []

        def kill_mid_generation(piece):
            if not killed and model.step >= 40:
                workers.processes[1].kill()
                workers.processes[1].wait()
                killed.append(time.perf_counter())

        try:
            t = time.perf_counter()
            result = generate(model, tokenizer, "", 256, on_text=kill_mid_generation)
            elapsed = time.perf_counter() - t
            report = model.report()
        finally:
            model.close()
            context.destroy(linger=0)
    assert killed and result.text == known_answer
    (recovery,) = report["recoveries"]
    assert recovery["kind"] == "lost" and len(recovery["lost"]) == 1 and recovery["lost"][0].startswith("stage-2@")
    assert recovery["replayed_tokens"] >= 40
    assert recovery["detected_after_s"] < 5.0  # the dropped connection, not the 10 s timeout
    assert all(not name.startswith("stage-2@") for name, _, _ in recovery["members"])
    assert elapsed < 60


def test_without_recovery_a_killed_worker_stops_generation_naming_it(stories_weights):
    with local_stage_workers(2) as workers:
        context, links = native_links(workers, stories_weights, timeout=3.0)
        model = PipelineModel(stories_weights, links, even_stages(stories_weights.config, 2), CONTEXT, recover=False)
        try:
            model.forward([1, 2, 3])
            workers.processes[1].kill()
            workers.processes[1].wait()
            with pytest.raises(PipelineError, match="stage-2@.*(dropped its connection|did not answer)"):
                model.forward([4])
        finally:
            model.close()
            context.destroy(linger=0)


def ask(sock, frames, timeout_ms=5000):
    sock.send_multipart(frames)
    assert sock.poll(timeout_ms), "the worker did not answer"
    return decode(sock.recv_multipart())


def test_bad_input_is_refused_with_a_reason_and_the_worker_survives(stories_weights):
    from halo.transport.reliable import client_socket

    sha = model_fingerprint(stories_weights.source)
    hello = {"protocol": 1, "model_sha256": sha, "context": 64, "start": 0, "stop": 3, "weights": "fp32",
             "session": "s1"}
    with local_stage_workers(1) as workers:
        context = zmq.Context()
        sock = client_socket(context, workers.key)
        sock.connect(workers.endpoints[0])
        try:
            for fields, reason in [({**hello, "protocol": 9}, "stage protocol 9"),
                                   ({**hello, "model_sha256": "0" * 64}, "model mismatch"),
                                   ({**hello, "start": 3, "stop": 3}, "not a non-empty range"),
                                   ({**hello, "stop": 99}, "not a non-empty range"),
                                   ({**hello, "context": 10 ** 6}, "context"),
                                   ({**hello, "weights": "fp8"}, "weight format")]:
                reply = ask(sock, encode(Message("hello", fields)))
                assert reply.kind == "refused" and reason in reply.fields["reason"], (fields, reply.fields)
            assert "malformed" in ask(sock, [b"garbage", b"x"]).fields["reason"]
            forward = {"session": "s1", "start_pos": 0, "head": {"top_k": 1, "all_positions": False}}
            reply = ask(sock, encode(Message("forward", forward, [np.array([1, 2], np.int64)])))
            assert reply.kind == "error" and "before hello" in reply.fields["reason"]
            assert ask(sock, encode(Message("hello", hello))).kind == "ready"
            for fields, arrays, reason in [
                    ({**forward, "session": "other"}, [np.array([1], np.int64)], "not in session"),
                    (forward, [np.zeros((1, 64), np.float32)], "takes int64 input"),
                    (forward, [np.array([1, 600], np.int64)], "token ids"),
                    ({**forward, "start_pos": 5}, [np.array([1], np.int64)], "hole in the KV cache"),
                    ({**forward, "start_pos": -2}, [np.array([1], np.int64)], "start_pos >= 0"),  # numpy wrapped it
                    (forward, [np.ones(65, np.int64)], "outside the context"),
                    ({**forward, "head": {"top_k": -1}}, [np.array([1], np.int64)], "bad head request")]:
                reply = ask(sock, encode(Message("forward", fields, arrays)))
                assert reply.kind == "error" and reason in reply.fields["reason"], (fields, reply.fields)
            reply = ask(sock, encode(Message("forward", forward, [np.array([1, 403], np.int64)])))
            assert reply.kind == "output" and reply.arrays[0].shape == (2, 64)
        finally:
            context.destroy(linger=0)
        assert workers.processes[0].poll() is None


def test_a_coordinator_with_the_wrong_key_is_not_served(stories_weights, tmp_path):
    other = generate_key(tmp_path / "other.key")
    with local_stage_workers(1) as workers:
        context = zmq.Context()
        link = NativeStage(context, workers.endpoints[0], other, False, 1.0, model_fingerprint(stories_weights.source),
                           hello_timeout_s=1.5)
        try:
            with pytest.raises(Exception, match="did not answer|cluster key"):
                link.probe()
        finally:
            link.close()
            context.destroy(linger=0)


def test_cli_runs_a_saved_pipeline_plan_with_the_master_holding_a_stage(tmp_path, known_answer):
    with local_stage_workers(1) as workers:
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(f"""[cluster]
context = 512
weights = "fp32"
[[device]]
name = "coordinator"
memory_mb = 1
compute_gflops = 10
master = true
[[device]]
name = "worker"
address = "{workers.endpoints[0].split('://')[1]}"
memory_mb = 1
compute_gflops = 10
""")
        plan = tmp_path / "plan.json"
        out = subprocess.run([sys.executable, "-m", "halo.cli.master", "plan", "--cluster", str(cluster), "--mode", "pipeline",
                              "--out", str(plan)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        doc = json.loads(plan.read_text())  # 1 MB each holds nothing: hand-edit the stages, as a person may
        doc["stages"] = [{"worker": "coordinator", "start": 0, "stop": 3}, {"worker": "worker", "start": 3, "stop": 7}]
        doc["complete"] = True
        plan.write_text(json.dumps(doc))
        out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--plan", str(plan), "--key",
                              str(workers.key_path), "--json", "--context", "512"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["text"] == known_answer
        stages = result["pipeline"]["stages"]
        assert [(s["worker"], s["start"], s["stop"]) for s in stages] == [("coordinator", 0, 3), ("stage-1@" + workers.endpoints[0].split("://")[1], 3, 7)]
        doc["stages"][1]["stop"] = 6
        plan.write_text(json.dumps(doc))
        out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--plan", str(plan), "--key",
                              str(workers.key_path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "partial" in out.stderr
        doc["stages"][1]["stop"], doc["model"]["dim"] = 7, 128  # a plan of another model with as many layers: it ran
        plan.write_text(json.dumps(doc))
        out = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--plan", str(plan), "--key",
                              str(workers.key_path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "the plan was made for another model" in out.stderr and "width 128" in out.stderr


def test_the_self_benchmark_recovers_layer_time_and_overhead_despite_one_disturbed_sample(monkeypatch):
    """A fake engine on a fake clock: 3 ms per layer, 1 ms per call; one sample of each range is slowed by
    50 ms (another process): the minimum ignores it, and the per-layer time comes from a 1-vs-3-layer span."""
    from halo.pipeline import profile

    clock = [0.0]
    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock[0])

    class FakeEngine:
        def __init__(self, start, stop):
            self.layers, self.calls = stop - start, 0

        def forward(self, x, pos):
            self.calls += 1
            clock[0] += 0.001 + 0.003 * self.layers + (0.05 if self.calls == 5 else 0.0)

    per_layer, overhead = profile.time_engine(FakeEngine, n_layers=8, dim=4)
    assert per_layer == pytest.approx(0.003) and overhead == pytest.approx(0.001)
    assert profile.time_engine(FakeEngine, n_layers=1, dim=4) == (pytest.approx(0.004), 0.0)


def test_status_shows_a_stage_worker_instead_of_failing_on_it():
    """`halo-master status --agents` on a halo-stage-worker ended in KeyError: 'profile' (its answer has no device
    profile: it measures itself when a coordinator probes it)."""
    with local_stage_workers(1) as workers:
        out = subprocess.run([sys.executable, "-m", "halo.cli.master", "status", "--agents",
                              workers.endpoints[0].split("://")[1], "--key", str(workers.key_path)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "stage worker, idle" in out.stdout and "0 forwards" in out.stdout, out.stdout


@pytest.mark.parametrize("extra", [["--sync", "halo"], ["--algorithm", "exact"], ["--all-devices"],
                                   ["--mlp-group-size", "64"]])
def test_a_pipeline_plan_refuses_what_only_tensor_parallel_planning_reads(tmp_path, extra):
    """They were accepted without a word, and the same plan written."""
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('[cluster]\ncontext = 64\nweights = "fp32"\n[[device]]\nname = "gpu"\naddress = "10.0.0.2:7070"\n'
                       'memory_mb = 1000\ncompute_gflops = 100\n')
    out = subprocess.run([sys.executable, "-m", "halo.cli.master", "plan", "--cluster", str(cluster), "--mode", "pipeline",
                          *extra], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"{extra[0]}: tensor-parallel planning only" in out.stderr, out.stderr


def test_a_pipeline_cluster_file_s_budgets_and_addresses_hold(stories_weights, tmp_path, monkeypatch):
    """A cluster file's [cluster] context and weights, its plaintext addresses and --authorized-agents were ignored in
    pipeline mode (a 64-token budget ran 100 tokens in a wider format; --insecure talked plaintext to a LAN address
    without --insecure-lan; device keys were refused for want of the file given). Now as tensor-parallel mode."""
    from contextlib import ExitStack

    from halo.pipeline.connect import connect_pipeline

    def cluster(weights: str, address: str = "local") -> str:
        path = tmp_path / f"{weights}-{address.replace(':', '_')}.toml"
        path.write_text(f'[cluster]\ncontext = 64\nweights = "{weights}"\n[[device]]\nname = "me"\naddress = "local"\n'
                        f'memory_mb = 1000\ncompute_gflops = 10\nmaster = true\n'
                        + (f'[[device]]\nname = "pi"\naddress = "{address}"\nmemory_mb = 1000\ncompute_gflops = 10\n'
                           if address != "local" else ""))
        return str(path)

    with ExitStack() as stack:
        model = connect_pipeline(stories_weights, stack, cluster=cluster("fp32"), insecure=True)
        assert model.max_seq_len == 64  # the file's, where no --context is given
    with ExitStack() as stack, pytest.raises(ConfigError, match="budgets a KV cache of 64 tokens and this run needs 100"):
        connect_pipeline(stories_weights, stack, cluster=cluster("fp32"), insecure=True, context=100)
    with ExitStack() as stack, pytest.raises(ConfigError, match="budgets memory for int4 weights and this run computes"):
        connect_pipeline(stories_weights, stack, cluster=cluster("int4"), insecure=True)
    with ExitStack() as stack, pytest.raises(ConfigError, match="192.0.2.10:7080, which is not a loopback address"):
        connect_pipeline(stories_weights, stack, cluster=cluster("fp32", "192.0.2.10:7080"), insecure=True)

    seen = []

    def master_key(key, authorized_agents=None):
        seen.append((key, authorized_agents))
        raise ConfigError("stop here")

    monkeypatch.setattr("halo.transport.reliable.master_key", master_key)
    with ExitStack() as stack, pytest.raises(ConfigError, match="stop here"):
        connect_pipeline(stories_weights, stack, workers=["127.0.0.1:7399"], key="m.key",
                         authorized_agents="agents.txt")
    assert seen == [("m.key", "agents.txt")]


def test_a_cuda_stage_in_fp16_is_priced_by_the_gpu_s_free_memory(monkeypatch):
    """The fp16 CUDA engine ("torch-cuda-fp16", what --weights native/int8 run as on a GPU) reported the host's free
    RAM as its memory: the pipeline planner priced a GPU stage by the wrong device."""
    import sys
    import types

    from halo.edge_agent.stage_worker import _free_memory

    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(mem_get_info=lambda: (123e6, 456e6)))
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert _free_memory("torch-cuda-fp16") == _free_memory("torch-cuda") == 123e6
    assert _free_memory("numpy-cpu") != 123e6
