"""The bounded cache of built MLP groups (HALO mode under a memory budget): what it keeps, what it counts, and
that a device computing from it gives what one holding every group gives."""

import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from halo.compute.group_cache import GroupCache
from halo.compute.linear import COMPACT_KERNEL, projection_kernel
from halo.compute.neuron_groups import GroupLayout
from halo.compute.remap import MIN_RESIDENT_PER_BYTE, RESIDENT_MARGIN, Remapper
from halo.errors import ConfigError


@dataclass
class Built:
    key: tuple
    nbytes: int = 10


def test_the_cache_keeps_the_most_recently_used_groups_within_its_capacity():
    cache = GroupCache(capacity_bytes=30)
    built = []

    def build(key):
        built.append(key)
        return Built(key)

    cache.filling = False
    for key in [(0, 0), (0, 1), (0, 2), (0, 0), (0, 3)]:  # (0, 0) used again: (0, 1) is the least recent
        assert cache.get(key, lambda key=key: build(key)).key == key
    assert (0, 1) not in cache and all(k in cache for k in [(0, 0), (0, 2), (0, 3)])
    assert cache.held_bytes == 30 and len(cache) == 3
    assert built == [(0, 0), (0, 1), (0, 2), (0, 3)]
    s = cache.stats
    assert (s.hits, s.stalls, s.prefetched, s.evicted, s.built_bytes) == (1, 4, 0, 1, 40)
    cache.get((0, 1), lambda: build((0, 1)), ahead=True)
    assert cache.stats.prefetched == 1 and cache.stats.evicted == 2


def test_layers_visited_in_turn_keep_the_layers_that_come_next():
    """Every token visits layers 0, 1, 2 in turn. Holding 4 of the 6 groups, least-recently-used eviction would always
    have just evicted the layer that comes next (no hit ever); evicting the layer computed last keeps the others."""
    cache = GroupCache(capacity_bytes=40)
    cache.filling = False
    for _ in range(5):
        for layer in range(3):
            for group in range(2):
                cache.get((layer, group), lambda key=(layer, group): Built(key))
    assert cache.held_bytes <= 40 and cache.stats.hits >= 6  # 2 of 3 layers' groups hit from the third token on


def test_groups_the_ranking_moved_away_from_go_before_those_the_last_token_used():
    """Rankings change a little from token to token: 3 of a layer's 8 groups are used, and each token one layer (at
    random) swaps one of them. With room for every group in use and a few more, a group a token needs again is still
    held: the only builds are the swapped-in groups. (Evicting by layer order alone evicted the groups just computed,
    which the next token needed again: 59 builds here instead of 33.)"""
    layers, rng = 6, np.random.default_rng(4)
    cache = GroupCache(capacity_bytes=10 * (3 * layers + 4))
    used = {l: list(rng.choice(8, 3, replace=False)) for l in range(layers)}
    for token in range(40):
        cache.begin_pass()
        if token >= 2:  # the first two tokens fill the cache
            layer = int(rng.integers(layers))
            used[layer][rng.integers(3)] = rng.choice([g for g in range(8) if g not in used[layer]])
        for l in range(layers):
            for g in used[l]:
                cache.get((l, int(g)), lambda key=(l, int(g)): Built(key))
        if token == 1:
            cache.filling = False
    assert cache.held_bytes <= cache.capacity_bytes and cache.stats.stalls <= 38  # one swap a token


def test_loading_two_layers_ahead_keeps_the_next_layer_loaded_first():
    """The load thread builds layer c+1's groups, then (the next ranking known) c+2's, while layer c computes: c+2's
    must evict a layer already computed, not the c+1 groups built a moment ago for the next computation."""
    cache = GroupCache(capacity_bytes=60)
    cache.filling = False
    for layer in range(3):
        for group in range(2):
            cache.get((layer, group), lambda key=(layer, group): Built(key))  # computing layer 2 now
    for layer in (3, 4):
        for group in range(2):
            cache.get((layer, group), lambda key=(layer, group): Built(key), ahead=True)
    assert (3, 0) in cache and (3, 1) in cache and (4, 0) in cache and (4, 1) in cache
    assert (2, 0) in cache and (2, 1) in cache  # in use
    assert cache.held_bytes == 60 and cache.stats.evicted == 4  # layers 1 and 0, computed before


def test_a_group_being_built_is_waited_for_not_built_twice():
    cache = GroupCache(capacity_bytes=None)
    started, builds = threading.Event(), []

    def slow():
        builds.append(1)
        started.set()
        time.sleep(0.2)
        return Built((1, 1))

    loader = threading.Thread(target=lambda: cache.get((1, 1), slow, ahead=True))
    loader.start()
    started.wait(5)
    assert cache.get((1, 1), slow).key == (1, 1)  # the computation waits for the load thread's build
    loader.join(5)
    assert builds == [1] and cache.stats.stall_ms >= 100


def ranked_tokens(layout, layers, tokens, seed):
    rng = np.random.default_rng(seed)
    return [{l: rng.permutation(layout.n_mlp_groups)[None, :] for l in layers} for _ in range(tokens)]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_bounded_device_computes_what_an_unbounded_one_does(stories_weights, overlap):
    """A device whose built groups are capped (two layers' worth of its ranks, a fraction of every candidate) gives
    the same partial sums token after token as a bounded one whose cache holds every candidate (both compute
    compact groups from their arrays), and those of one holding every group as kernels (the same bits where halo's C
    kernel computes both; within int8 activation rounding of onnxruntime's); what it had to build again is counted,
    and it never holds more than its capacity."""
    c = stories_weights.config
    layout = GroupLayout.for_model(c)
    ranges = {l: (2, 5) for l in range(c.n_layers)}
    full = Remapper(stories_weights, layout, ranges, fmt="int8")
    group_bytes = full.cache.held_bytes // len(full.cache)
    capacity = 7 * group_bytes  # two layers of 3 ranks and one group more: less than the 15 groups of its ranks
    bounded = Remapper(stories_weights, layout, ranges, fmt="int8", cache_bytes=capacity, load_overlap=overlap)
    ample = Remapper(stories_weights, layout, ranges, fmt="int8", cache_bytes=full.cache.held_bytes + group_bytes)
    assert len(full.cache) == len(ample.cache) == c.n_layers * layout.n_mlp_groups and 6 <= len(bounded.cache) <= 7
    assert full.report()["group_cache"]["kernel"] == projection_kernel()
    assert bounded.report()["group_cache"]["kernel"] == COMPACT_KERNEL
    same_kernel = projection_kernel() == COMPACT_KERNEL  # halo's C kernel built: every group is a DequantKernel
    rng = np.random.default_rng(0)
    for rankings in ranked_tokens(layout, ranges, 6, seed=1):
        for remapper in (full, bounded, ample):
            remapper.begin()
            remapper.rankings.update(rankings)
        x = rng.standard_normal((1, c.dim)).astype(np.float32)
        for l in ranges:
            if overlap:  # as the worker does: the next layer's groups load while this one computes
                bounded.loading[l] = bounded.pool.submit(bounded._load, l)
            partial = bounded.mlp_partial(l, x)
            np.testing.assert_array_equal(partial, ample.mlp_partial(l, x))
            if same_kernel:
                np.testing.assert_array_equal(partial, full.mlp_partial(l, x))
            else:  # onnxruntime's kernels: int8 activations rounded their way (1/254 of a block)
                np.testing.assert_allclose(partial, full.mlp_partial(l, x), atol=0.1)
            assert bounded.cache.held_bytes <= capacity
    stats = bounded.report()["group_cache"]
    assert stats["prefetched" if overlap else "stalls"] > 0 and stats["evicted"] > 0 and stats["built_bytes"] > 0
    assert stats["capacity_bytes"] == capacity and full.report()["group_cache"]["capacity_bytes"] is None
    assert full.cache.stats.stalls == 0 and full.cache.stats.evicted == 0 and ample.cache.stats.evicted == 0
    for r in (full, bounded, ample):
        r.close()


@pytest.mark.skipif(COMPACT_KERNEL != "halo._nbits", reason="halo._nbits was not built (no C compiler)")
def test_a_bounded_devices_decode_step_is_one_c_call_a_layer_with_the_unbounded_bits(tmp_path, monkeypatch):
    """Compact groups take the decode step's fused C call (norm, every group's gate/up, SwiGLU and down at once), as
    held kernels do: computed group by group from Python, a bounded SmolLM2 agent took 1.5x the compute with every
    group in its cache. Same bits as the unbounded device, norm included (a Q4_0 GGUF: stories260K's int8 blocks are
    padded, which the C steps do not take)."""
    from gguf_models import tiny_gguf

    import halo.compute.neuron_groups
    from halo.model.loader import load_weights

    weights = load_weights(tiny_gguf(tmp_path / "model.gguf", "Q4_0", seed=5))
    c = weights.config
    layout = GroupLayout.for_model(c)
    ranges = {l: (1, 4) for l in range(c.n_layers)}
    full = Remapper(weights, layout, ranges, fmt="native")
    bounded = Remapper(weights, layout, ranges, fmt="native", cache_bytes=full.cache.held_bytes)
    calls = []
    step = halo.compute.neuron_groups._nbits.mlp_step
    monkeypatch.setattr(halo.compute.neuron_groups._nbits, "mlp_step", lambda *a: calls.append(len(a[3])) or step(*a))
    x = np.random.default_rng(3).standard_normal((1, c.dim)).astype(np.float32)
    for rankings in ranked_tokens(layout, ranges, 2, seed=4):
        for remapper in (full, bounded):
            remapper.begin()
            remapper.rankings.update(rankings)
        for l in ranges:
            norm = weights.layers[l].mlp_norm
            calls.clear()
            partial = bounded.mlp_partial(l, x, norm, c.norm_eps)
            assert calls == [3], "the bounded device's groups were not computed in one C call"
            np.testing.assert_array_equal(partial, full.mlp_partial(l, x, norm, c.norm_eps))
    for r in (full, bounded):
        r.close()


def test_a_cache_smaller_than_two_layers_of_ranks_is_refused(stories_weights):
    layout = GroupLayout.for_model(stories_weights.config)
    with pytest.raises(ConfigError, match=r"less than two layers of this share's groups .* fewer MLP ranks or more memory"):
        Remapper(stories_weights, layout, {0: (0, 4), 1: (0, 4)}, fmt="int8", cache_bytes=1000)


def test_an_agent_under_a_memory_budget_keeps_compact_groups_and_the_same_tokens(stories_weights, tmp_path,
                                                                                  monkeypatch, nack_reserve):
    """halo-agent --memory-budget: in HALO mode (halo-tcp: reliable, so the tokens are deterministic) with int8
    weights, an agent whose budget cannot hold every candidate MLP group as kernels (measured at the start: here a
    group kernel costs ~10x its weights in process memory, its objects and first call's buffers around 5 KB of
    weights) holds them as compact groups within its budget (its status says so) and gives the tokens of
    unbounded agents; after `halo-agent prepare` it reads them from the prepared groups,
    with the same tokens again. (What a cache smaller than the candidates rebuilds and evicts: the test above.)"""
    import subprocess
    import sys

    from halo.distributed import LocalCluster, cluster_model
    from halo.distributed.remote import ask_status
    from halo.sync import SyncSettings

    monkeypatch.setenv("HALO_PREPARED_DIR", str(tmp_path / "prepared"))  # the agents inherit it

    def run(extra):
        with LocalCluster(2, extra_args=extra) as cluster:
            model = cluster_model(stories_weights, cluster.endpoints, cluster.key, context=64, fmt="int8",
                                  sync=SyncSettings(mode="halo-tcp"))
            logits, tokens = model.forward([1]), []
            for _ in range(12):
                tokens.append(int(np.argmax(logits)))
                logits = model.forward([tokens[-1]])
            memory = [s["memory"] for s in ask_status(cluster.endpoints, cluster.key).values()]
            model.close()
            return tokens, memory

    free_tokens, free = run(())
    # 0.85 MB beyond what the partials kept for NACKs may take (a 64-position prompt's: 0.13 MB, reserved at hello):
    # ~0.4 MB left to the groups once the other shards and the KV cache are measured (0.38-0.5 MB of the 0.85,
    # depending on the heap). The candidates are 0.23 MB of weights: as kernels they would take at least
    # MIN_RESIDENT_PER_BYTE x margin = 0.54 MB however little the calibration measures (it measured 5-10x, and a
    # budget of 2.5 MB held them as kernels once in CI), so the agent must go compact.
    budget = ("--memory-budget", f"{0.85 + nack_reserve(stories_weights, 64) / 1e6:.3f}")
    bounded_tokens, bounded = run(budget)
    assert bounded_tokens == free_tokens
    for unbounded, memory in zip(free, bounded):
        cache, free_cache = memory["group_cache"], unbounded["group_cache"]
        assert free_cache["capacity_bytes"] is None and free_cache["kernel"] == projection_kernel()
        assert free_cache["stalls"] == 0  # its default budget (the machine's memory) holds them as kernels
        assert cache["capacity_bytes"] is not None, cache  # compact groups: bounded
        assert cache["kernel"] == COMPACT_KERNEL and cache["resident_budget_bytes"] < 0.85e6 and not cache["prepared"]
        assert 0 < cache["held_bytes"] <= cache["capacity_bytes"] <= cache["resident_budget_bytes"]
        assert free_cache["held_bytes"] * MIN_RESIDENT_PER_BYTE * RESIDENT_MARGIN > cache["resident_budget_bytes"]
        # the same groups in their compact bytes (all of them, unless the heap left less than their 0.23 MB)
        assert cache["held_bytes"] / cache["groups"] == free_cache["held_bytes"] / free_cache["groups"]
    done = subprocess.run([sys.executable, "-P", "-m", "halo.edge_agent", "prepare", "--weights", "int8"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "prepared 8 MLP groups x 5 layers" in done.stdout, done.stderr
    prepared_tokens, prepared = run(budget)
    assert prepared_tokens == free_tokens and all(m["group_cache"]["prepared"] for m in prepared)


def test_the_master_keeps_its_re_mapped_groups_within_its_budget_and_gives_the_same_tokens(stories_weights,
                                                                                          monkeypatch, nack_reserve):
    """HALO mode: the master re-maps MLP groups as an agent does, so it budgets them as one. Where its default budget
    (what its memory cgroup leaves, here said to be 0.4 MB) cannot hold every candidate as kernels it holds compact
    groups within it, and the tokens are those of a master with room for them all (halo-tcp: deterministic)."""
    import halo.runtime.measure
    from halo.distributed import LocalCluster, cluster_model
    from halo.sync import SyncSettings

    def run():
        with LocalCluster(1) as cluster:
            model = cluster_model(stories_weights, cluster.endpoints, cluster.key, context=64, fmt="int8",
                                  sync=SyncSettings(mode="halo-tcp"))
            try:
                logits, tokens = model.forward([1]), []
                for _ in range(8):
                    tokens.append(int(np.argmax(logits)))
                    logits = model.forward([tokens[-1]])
                return tokens, model.worker.remapper.report()["group_cache"]
            finally:
                model.close()

    free_tokens, free = run()
    monkeypatch.setattr(halo.runtime.measure, "default_memory_budget",
                        lambda: 400_000 + nack_reserve(stories_weights, 64, agent=False))
    bounded_tokens, bounded = run()
    assert free["capacity_bytes"] is None and free["kernel"] == projection_kernel(), free
    assert bounded["capacity_bytes"] is not None and 0 < bounded["held_bytes"] <= bounded["capacity_bytes"] < 400_000, bounded
    assert bounded["kernel"] == COMPACT_KERNEL and bounded_tokens == free_tokens, (bounded, bounded_tokens, free_tokens)


def test_prepared_groups_compute_exactly_what_the_model_file_gives(stories_weights, tmp_path):
    """halo-agent prepare writes every MLP group in kernel form, group-major; a group built from those bytes is the
    same kernel as one built from the model file: bitwise the same output."""
    from halo.compute.neuron_groups import CompactMlpGroup, MlpShard
    from halo.compute.prepared import PreparedGroups, prepare
    from halo.model.loader import model_fingerprint

    layout = GroupLayout.for_model(stories_weights.config)
    sha = model_fingerprint(stories_weights.source)
    out = prepare(stories_weights, sha, "int8", layout, tmp_path / "prepared")
    groups = PreparedGroups(out, sha, "int8", layout, stories_weights.config.n_layers)
    x = np.random.default_rng(3).standard_normal((3, stories_weights.config.dim)).astype(np.float32)
    for layer, group in [(0, 0), (2, 5), (4, layout.n_mlp_groups - 1)]:  # the last group is smaller (172 = 7 x 22 + 18)
        np.testing.assert_array_equal(groups.shard(layer, group).forward(x),
                                      MlpShard(stories_weights.layers[layer], layout, [group], "int8").forward(x))
        compact = groups.compact_group(layer, group)  # what a memory-bounded device holds: the read bytes themselves
        np.testing.assert_array_equal(compact.forward(x),
                                      CompactMlpGroup.build(stories_weights.layers[layer], layout, group, "int8").forward(x))
        assert compact.nbytes == groups.groups[layer * layout.n_mlp_groups + group]["bytes"]


def test_prepare_never_replaces_a_directory_it_did_not_write(stories_weights, tmp_path, monkeypatch):
    """`halo-agent prepare --out DIR` removed DIR whole (a user's `--out ~/models` lost every file there); `--out .`
    was a ValueError traceback. It now writes into a new or empty directory, or over one it wrote before."""
    from halo.compute.prepared import prepare
    from halo.model.loader import model_fingerprint

    layout, sha = GroupLayout.for_model(stories_weights.config), model_fingerprint(stories_weights.source)
    mine = tmp_path / "models"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match=r"holds files prepare did not write \(notes.txt, sub\): give a new or empty"):
        prepare(stories_weights, sha, "int8", layout, mine)
    assert (mine / "notes.txt").read_text() == "precious" and (mine / "sub").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        prepare(stories_weights, sha, "int8", layout, tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert prepare(stories_weights, sha, "int8", layout, Path(".")) == empty  # "." is the directory it names
    assert prepare(stories_weights, sha, "int8", layout, Path(".")) == empty  # and its own output is replaced
    assert sorted(p.name for p in empty.iterdir()) == ["groups.bin", "manifest.json"]


def test_prepare_writes_a_partial_of_its_own_and_removes_it_when_stopped(stories_weights, tmp_path):
    """Two prepares at once shared `<dir>.partial` (a groups.bin of the right size and mixed bytes went in as valid);
    Ctrl-C left the partial behind (tens of MB). Another's partial is now left alone, and its own is removed."""
    from halo.compute.prepared import prepare
    from halo.model.loader import model_fingerprint

    layout, sha = GroupLayout.for_model(stories_weights.config), model_fingerprint(stories_weights.source)
    other = tmp_path / "prepared.partial"  # another prepare's, mid-write (the old shared name)
    other.mkdir()
    (other / "groups.bin").write_bytes(b"half")

    def stop(done, total):
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(stories_weights, sha, "int8", layout, tmp_path / "prepared", progress=stop)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared.partial"]
    assert prepare(stories_weights, sha, "int8", layout, tmp_path / "prepared") == tmp_path / "prepared"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared", "prepared.partial"]
    assert (other / "groups.bin").read_bytes() == b"half"
    umask = os.umask(0)
    os.umask(umask)  # the mode mkdir gives: an agent's service account reads what root prepared (mkdtemp's 0700 not)
    assert (tmp_path / "prepared").stat().st_mode & 0o777 == 0o777 & ~umask


def test_prepared_groups_another_user_cannot_read_are_named(stories_weights, monkeypatch):
    """A prepared directory the agent's user could not enter ended its HALO-mode hello in a bare PermissionError."""
    from pathlib import Path as RealPath

    from halo.compute.prepared import find_prepared

    def unreadable(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(RealPath, "exists", unreadable)
    with pytest.raises(ConfigError, match=r"this agent's user cannot read the prepared groups there; make them readable"):
        find_prepared(stories_weights, "0" * 64, "int8", GroupLayout.for_model(stories_weights.config))


def test_a_stale_or_damaged_prepared_directory_is_refused_with_what_to_run(stories_weights, tmp_path):
    import json

    from halo.compute.prepared import VERSION, PreparedGroups, prepare
    from halo.model.loader import model_fingerprint

    layout = GroupLayout.for_model(stories_weights.config)
    sha = model_fingerprint(stories_weights.source)
    out = prepare(stories_weights, sha, "int8", layout, tmp_path / "prepared")
    with pytest.raises(ConfigError, match=r"prepared for format 'int8', this session needs 'native'; run: halo-agent prepare"):
        PreparedGroups(out, sha, "native", layout, stories_weights.config.n_layers)
    with pytest.raises(ConfigError, match=r"prepared for model_sha256 .* run: halo-agent prepare"):
        PreparedGroups(out, "0" * 64, "int8", layout, stories_weights.config.n_layers)
    data = out / "groups.bin"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(ConfigError, match=r"groups.bin is missing or truncated \(expected \d+ bytes\); run: halo-agent prepare"):
        PreparedGroups(out, sha, "int8", layout, stories_weights.config.n_layers)
    manifest = json.loads((out / "manifest.json").read_text())
    data.write_bytes(data.read_bytes() + bytes(10))
    manifest["groups"][3]["kernels"][0]["arrays"][0][1][0] += 1  # a forged shape: refused at start, not mid-generation
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"manifest.json, layer 0 group 3: arrays .* where the kernel needs"):
        PreparedGroups(out, sha, "int8", layout, stories_weights.config.n_layers)
    (out / "manifest.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(ConfigError, match=rf"prepared for version 99, this session needs {VERSION}"):
        PreparedGroups(out, sha, "int8", layout, stories_weights.config.n_layers)


def kernel_weights(kernel) -> np.ndarray:
    """A DequantKernel's weights as float32 [n, k]: its codes, zero point, scales and offsets, by plain numpy."""
    spec, (codes, scales, offsets) = kernel.spec, kernel.arrays()  # [n, blocks, bytes], [n, blocks]
    n, blocks, _ = codes.shape
    if spec.bits == 4:  # byte i: input 2i in the low nibble, 2i + 1 in the high one
        codes = np.stack([codes & 15, codes >> 4], axis=3).reshape(n, blocks, spec.block)
    w = (codes.astype(np.float32) - (1 << (spec.bits - 1))) * scales.astype(np.float32)[..., None]
    if offsets is not None:
        w += offsets.astype(np.float32)[..., None]
    return w.reshape(n, -1)[:, :kernel.k]


def kernel_reference(kernel, x: np.ndarray) -> np.ndarray:
    """What a kernel computes, in float64 from its definition: its activations quantized per block (one or two int8
    terms, linear.quantized_activations) times its weights."""
    from halo.compute.linear import quantized_activations

    block, k = kernel.spec.block, kernel.k
    padded = np.pad(x, ((0, 0), (0, -k % block)))
    seen = quantized_activations(padded.reshape(len(x), -1, block), kernel.terms).reshape(len(x), -1)[:, :k]
    return seen.astype(np.float64) @ kernel_weights(kernel).T.astype(np.float64)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "int8"])
def test_a_compact_group_computes_the_files_weights_with_int8_activations(stories_weights, tmp_path, qtype):
    """What a memory-bounded device computes a re-mapped group with (the group's compact codes and scales, no
    onnxruntime session) is its kernels' definition: the stored weights exactly (the file's blocks; int8: its own
    codes of the float32 weights) times activations quantized per block (two int8 terms for GGUF blocks, one for
    int8), in prefill and decode, by halo's C kernel and by numpy alike; it holds the group's compact bytes."""
    from gguf_models import tiny_gguf

    from halo.compute.linear import DequantKernel
    from halo.compute.neuron_groups import CompactMlpGroup, MlpShard, mlp_group_kernels
    from halo.model.loader import load_weights

    weights = stories_weights if qtype == "int8" else load_weights(tiny_gguf(tmp_path / "model.gguf", qtype, seed=5))
    fmt = "int8" if qtype == "int8" else "native"
    layout = GroupLayout.for_model(weights.config)
    rng = np.random.default_rng(2)
    for layer, group in [(0, 0), (1, layout.n_mlp_groups - 1)]:
        compact = CompactMlpGroup.build(weights.layers[layer], layout, group, fmt)
        assert [k.terms for k in (compact.gate_up, compact.down)] == [1 if fmt == "int8" else 2] * 2
        if fmt == "native":  # the file's blocks as stored: the dequantized fp32 model's weights exactly
            fp32 = MlpShard(weights.layers[layer], layout, [group], "fp32")
            assert np.array_equal(kernel_weights(compact.gate_up), np.concatenate(fp32.gate_up.matrices))

        def reference(x):
            h = kernel_reference(compact.gate_up, x).astype(np.float32)
            n = compact.down.k
            return kernel_reference(compact.down, h[:, :n] / (1 + np.exp(-h[:, :n])) * h[:, n:])

        for tokens in (1, 3, 9):
            x = rng.standard_normal((tokens, weights.config.dim)).astype(np.float32)
            want = reference(x)
            np.testing.assert_allclose(compact.forward(x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
        for kernel in (compact.gate_up, compact.down):  # halo's C kernel (where built) and numpy give the same sums
            for tokens in (1, 2, 5, 9):
                xk = rng.standard_normal((tokens, kernel.k)).astype(np.float32)
                want = kernel(xk, native=False)
                np.testing.assert_allclose(kernel(xk), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
                exact = kernel_reference(kernel, xk)
                np.testing.assert_allclose(want, exact, rtol=1e-4, atol=1e-4 * float(np.abs(exact).max()))
        kernels = [p.kernels[0] for p in mlp_group_kernels(weights.layers[layer], layout, group, fmt)]
        # its compact bytes: codes, scales and offsets (float16 where exact: Q4_0 / Q8_0's are), rows in 16-row tiles
        scale_bytes = [DequantKernel.scale_dtype_for(k).itemsize for k in kernels]
        assert [k.scale_dtype.itemsize for k in (compact.gate_up, compact.down)] == scale_bytes
        if qtype in ("Q4_0", "Q8_0"):
            assert scale_bytes == [2, 2]  # the file's float16 scales, as stored
        assert compact.nbytes == sum(-(-k.n // 16) * 16 * k.weights["codes"].shape[1]
                                     * (k.weights["codes"].shape[2] + size * (len(k.weights) - 1))
                                     for k, size in zip(kernels, scale_bytes))


def test_the_compact_kernel_is_built_and_refuses_arrays_that_do_not_fit():
    """The C kernel is there wherever a C compiler was (the install's optional extension), and its boundary names
    what is wrong with the arrays instead of reading past them."""
    from halo.compute import linear

    if linear._nbits is None:
        import sysconfig

        headers = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
        assert not (shutil.which("cc") and headers), "a C compiler and Python's headers are here but halo._nbits was " \
                                                     "not built: reinstall halo"
        pytest.skip("halo._nbits not built (no C compiler or no Python headers): numpy computes compact groups")
    nbits = linear._nbits
    packed = linear.pack(np.zeros((8, 2, 16), np.uint8), np.ones((8, 2), np.float32), None)  # 8 rows x 64 inputs
    assert packed.shape == (1, 2, 16 * 16 + 16 * 4)  # one tile of 16 rows: per block its codes, then 16 scales
    weight = (packed, 8, 4, 32, False, False, 2)  # (packed, n, bits, block, half, offsets, terms)
    x, out = np.ones((1, 64), np.float32), np.empty((1, 8), np.float32)
    for path in nbits.paths():
        nbits.matmul(weight, x, out, path=path)
        np.testing.assert_array_equal(out, np.full((1, 8), -8 * 64, np.float32))  # every weight (0 - 8) x 1

    def refused(error, match, weight=weight, x=x, out=out, **kw):
        with pytest.raises(error, match=match):
            nbits.matmul(weight, x, out, **kw)

    unit = r"\[tiles 1, blocks >= 1, unit 320\]"
    refused(ValueError, rf"packed must be {unit} \(16-row tiles of 8 rows", (np.zeros((1, 2, 300), np.uint8), *weight[1:]))
    refused(ValueError, r"packed must be \[tiles 2, blocks >= 1", (packed, 20, *weight[2:]))  # 20 rows need 2 tiles
    refused(ValueError, rf"packed must be {unit}", (packed[:, :0], *weight[1:]))  # no blocks
    refused(ValueError, r"packed must be \[tiles 1, blocks >= 1, unit 384\]", (*weight[:5], True, 2))  # offsets
    refused(ValueError, r"packed must be \[tiles 1, blocks >= 1, unit 288\]", (*weight[:4], True, False, 2))  # half
    refused(ValueError, r"packed holds values of type 'd'; it must be uint8", (packed.astype(np.float64), *weight[1:]))
    refused(TypeError, r"weight must be a \(packed, n, bits, block, half, offsets, terms\) tuple", weight[:6])
    refused(TypeError, "weight must be a", list(weight))
    refused(ValueError, "n must be a positive number of rows", (packed, 0, *weight[2:]))
    refused(ValueError, "the block a multiple of 4 up to 4096", (packed, 8, 8, 6148914691236517206, False, False, 2))
    refused(ValueError, "the block a multiple of 8", (packed, 8, 4, 36, False, False, 2))  # 4-bit: whole words
    refused(ValueError, "bits must be 4 or 8", (packed, 8, 3, 32, False, False, 2))
    refused(ValueError, r"terms must be 1 or 2 \(got 3\)", (*weight[:6], 3))
    refused(ValueError, "path avx1024: this CPU runs scalar", path="avx1024")
    refused(ValueError, r"x must be \[tokens, 64\] float32 inputs", x=np.ones((1, 63), np.float32))
    refused(ValueError, r"x holds values of type 'd'", x=np.ones((1, 64)))
    wide = np.ones((1, 64), np.float32)
    refused(ValueError, "out overlaps x", x=wide, out=wide[:, :8])
    refused(ValueError, r"threads must be 1..1024 \(got 0\)", threads=0)
    refused(ValueError, "out holds 4 values; the shapes given need 8", out=out[:, :4])
    nbits.matmul(weight, x.astype(">f4").astype("<f4"), out)  # an explicit byte order that is this machine's: taken


def test_the_kernels_prefetch_distance_is_chosen_for_the_cpu_settable_and_changes_no_result():
    """How far ahead the kernel asks for weights is a speed knob only (eval/results/kernel_prefetch.md): any distance
    gives the same bits, a distance out of range is refused, and the CPU's own choice is one of the measured two."""
    from halo.compute import linear

    if linear._nbits is None:
        pytest.skip("halo._nbits not built (no C compiler or no Python headers)")
    nbits = linear._nbits
    chosen = nbits.prefetch_units()
    assert chosen in (4, 32)  # Intel's, every other CPU's (halo/_nbits.c)
    rng = np.random.default_rng(3)
    n, blocks = 300, 64
    codes = rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8)
    packed = linear.pack(codes, (rng.random((n, blocks)) * 0.02).astype(np.float16), None)
    x = rng.standard_normal((1, blocks * 32)).astype(np.float32)
    outs = []
    try:
        for units in (1, 4, 32, 1024):
            assert nbits.prefetch_units(units) == units
            for path in nbits.paths():
                out = np.empty((1, n), np.float32)
                nbits.matmul((packed, n, 4, 32, True, False, 2), x, out, path=path)
                outs.append(out)
        for bad in (0, -1, 1025):
            with pytest.raises(ValueError, match=r"prefetch distance must be 1..1024 units"):
                nbits.prefetch_units(bad)
    finally:
        nbits.prefetch_units(chosen)
    assert nbits.prefetch_units() == chosen
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_a_device_over_its_cgroup_limit_shrinks_its_cache_not_below_two_layers(stories_weights, monkeypatch):
    """What the first passes make resident can exceed what the budget was measured from: each forward pass, a
    bounded device gives up the cache capacity its cgroup limit lacks (evicting at once), down to two layers of its
    ranks, and says so in its report."""
    import halo.compute.remap

    layout = GroupLayout.for_model(stories_weights.config)
    ranges = {l: (2, 5) for l in range(stories_weights.config.n_layers)}
    remapper = Remapper(stories_weights, layout, ranges, fmt="int8", cache_bytes=10**9)
    remapper.resident_budget = 10**9  # as when the budget came from the agent's memory
    group = remapper._group_bytes()
    held = remapper.cache.held_bytes
    monkeypatch.setattr(halo.compute.remap, "groups_headroom", lambda: -5 * group)
    remapper.begin()
    assert remapper.cache.capacity_bytes == 10**9 - 5 * group and remapper.cache.held_bytes == held  # room to spare
    remapper.cache.shrink(held)
    remapper.begin()
    assert remapper.cache.held_bytes <= held - 5 * group and remapper.report()["group_cache"]["shrunk_bytes"] > 0
    monkeypatch.setattr(halo.compute.remap, "groups_headroom", lambda: -10**9)
    remapper.begin()
    assert remapper.cache.capacity_bytes == remapper.floor > 5 * group and remapper.cache.held_bytes <= remapper.floor
    monkeypatch.setattr(halo.compute.remap, "groups_headroom", lambda: None)  # no limit: nothing changes
    remapper.begin()
    assert remapper.cache.capacity_bytes == remapper.floor
    remapper.close()


def test_mapped_files_are_advised_random_access():
    """Under a memory limit an agent turns off read-around on its file-backed mappings (code, the model): each
    evicted page faults back alone instead of with the disk's whole read-ahead window. The kernel shows the
    advice as the mapping's "rr" flag in /proc/self/smaps."""
    import mmap

    from halo.host.memory import read_mapped_files_at_random

    def flags_of(path: str) -> list[str]:
        lines = Path("/proc/self/smaps").read_text().splitlines()
        at = next(i for i, line in enumerate(lines) if line.endswith(path))
        return next(line for line in lines[at:] if line.startswith("VmFlags:")).split()[1:]

    with open(__file__, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        assert "rr" not in flags_of(__file__)
        assert read_mapped_files_at_random() > 0
        assert "rr" in flags_of(__file__)


def test_buffers_of_garbage_groups_are_read_into_again_and_idle_ones_freed():
    """A group's buffer goes back to the pool when the group is garbage (evicted and not being computed), and the
    next group read of that size takes it: no new pages mapped per read. `clear` lets the idle ones go."""
    from halo.host.memory import BufferPool

    class Group:
        pass

    pool = BufferPool()
    first = pool.take(4096)
    group = Group()
    pool.return_with(group, first)
    assert pool.take(4096) is not first and pool.idle_bytes == 0  # still in use: a new buffer
    address = first.ctypes.data
    del group, first
    assert pool.idle_bytes == 4096
    again = pool.take(4096)
    assert again.ctypes.data == address and pool.idle_bytes == 0
    pool.return_with(Group(), again)  # garbage at once
    assert pool.idle_bytes == 4096
    pool.clear()
    assert pool.idle_bytes == 0


@pytest.mark.parametrize("first_mb", [1, 12, 40])
def test_the_weight_arena_gives_every_matrix_its_whole_size_whatever_comes_first(first_mb):
    """A process whose first weights are larger than the arena's first (4 KB page) chunk gets them whole: an agent
    holding no attention but a share of TinyLlama's LM head (9.4 MB) failed to load with a reshape error."""
    from halo.host.memory import ARENA_CHUNK, FIRST_CHUNK, _WeightArena

    arena = _WeightArena()
    sizes = [first_mb << 20, 3 << 20, FIRST_CHUNK + 1, ARENA_CHUNK // 2 - 64, 100]
    buffers = [arena.take(n) for n in sizes]
    assert [len(b) for b in buffers] == sizes
    for i, b in enumerate(buffers):  # each its own bytes: writing one changes no other
        b[:] = i
    assert all((b == i).all() for i, b in enumerate(buffers))

@pytest.mark.parametrize("prepared", [False, True])
def test_a_bounded_device_maps_no_new_pages_per_group_it_reads(stories_weights, tmp_path, monkeypatch, prepared):
    """Token after token a bounded device reads groups it evicted back in, into the buffers of those it evicted:
    new pages are mapped only for the groups it holds at once (its capacity and one layer in flight), however many
    it reads."""
    import halo.host.memory
    from halo.compute.prepared import PreparedGroups, prepare
    from halo.model.loader import model_fingerprint

    c = stories_weights.config
    layout = GroupLayout.for_model(c)
    groups = None
    if prepared:
        sha = model_fingerprint(stories_weights.source)
        groups = PreparedGroups(prepare(stories_weights, sha, "int8", layout, tmp_path / "prepared"), sha, "int8",
                                layout, c.n_layers)
    ranges = {l: (2, 5) for l in range(c.n_layers)}
    mapped = []
    own_pages = halo.host.memory.own_pages
    monkeypatch.setattr(halo.host.memory, "own_pages", lambda n: mapped.append(n) or own_pages(n))
    remapper = Remapper(stories_weights, layout, ranges, fmt="int8", cache_bytes=10**9, load_overlap=False,
                        prepared=groups)
    group_bytes = remapper._group_bytes()
    remapper.cache.shrink(7 * group_bytes)
    mapped.clear()
    rng = np.random.default_rng(0)
    for rankings in ranked_tokens(layout, ranges, 6, seed=1):
        remapper.begin()
        remapper.rankings.update(rankings)
        for l in ranges:
            remapper.mlp_partial(l, rng.standard_normal((1, c.dim)).astype(np.float32))
    stats = remapper.cache.stats
    assert stats.stalls > 20 and len(mapped) <= 3  # the cache was full: only what is in flight beyond it is new
    remapper.close()


def test_sessions_under_a_memory_limit_give_their_buffers_back_after_each_run(monkeypatch):
    """An onnxruntime arena keeps its largest run's buffers (a prefill's) for good; under a cgroup memory limit
    halo's sessions run without one."""
    import halo.compute.linear

    monkeypatch.setattr(halo.compute.linear, "memory_limit", lambda: (256 << 20, 100 << 20))
    assert not halo.compute.linear.session_options().enable_cpu_mem_arena
    monkeypatch.setattr(halo.compute.linear, "memory_limit", lambda: None)
    assert halo.compute.linear.session_options(2).enable_cpu_mem_arena and halo.compute.linear.session_options(2).intra_op_num_threads == 2


def test_the_compact_kernel_reads_float16_scales_and_computes_each_row_alike_in_any_shard():
    """GGUF's scales and minimums are float16: the C kernel reads them as stored (same sums as their float32
    values), and a row's result does not depend on the rows computed with it (tiles, vector lanes, the tail,
    threads): a shard of rows gives bit for bit what the whole matrix gives for them, so splitting rows over
    devices or threads keeps the single-device numbers."""
    from halo.compute import linear

    if linear._nbits is None:
        pytest.skip("halo._nbits not built (no C compiler or no Python headers)")
    nbits = linear._nbits

    def weight(codes, scales, offsets):  # MatMulNBits' arrays as the kernel takes them (linear.pack)
        n, blocks, block_bytes = codes.shape
        return (linear.pack(codes, scales, offsets), n, block_bytes * 8 // block, block, scales.dtype == np.float16,
                True, 2)

    rng = np.random.default_rng(7)
    for bits, n in [(4, 1203), (8, 517)]:  # more rows than a tile, not a multiple of any vector width
        blocks, block = 5, 32
        codes = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
        scales = (rng.random((n, blocks)) * 0.02).astype(np.float16)
        offsets = (rng.standard_normal((n, blocks)) * 0.01).astype(np.float16)
        halves, floats = weight(codes, scales, offsets), weight(codes, scales.astype(np.float32), offsets.astype(np.float32))
        for tokens in (1, 3):
            x = rng.standard_normal((tokens, blocks * block)).astype(np.float32)
            half, full = np.empty((tokens, n), np.float32), np.empty((tokens, n), np.float32)
            nbits.matmul(halves, x, half)
            nbits.matmul(floats, x, full)
            np.testing.assert_array_equal(half, full)
            for threads, path in [(2, None), (3, None)] + [(1, p) for p in nbits.paths()]:  # every vector width
                split = np.empty((tokens, n), np.float32)
                nbits.matmul(halves, x, split, threads=threads, path=path)
                np.testing.assert_array_equal(split, half)
            w = (codes.astype(np.float32) if bits == 8 else
                 np.stack([codes & 15, codes >> 4], axis=3).reshape(n, blocks, block).astype(np.float32))
            w = (w - (1 << (bits - 1))) * scales.astype(np.float32)[..., None] + offsets.astype(np.float32)[..., None]
            seen = linear.quantized_activations(x.reshape(tokens, blocks, block), 2).reshape(tokens, -1)
            want = seen.astype(np.float64) @ w.reshape(n, blocks * block).T.astype(np.float64)
            np.testing.assert_allclose(half, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
            exact = x.astype(np.float64) @ w.reshape(n, blocks * block).T.astype(np.float64)  # two terms: ~1e-4 of it
            np.testing.assert_allclose(half, exact, rtol=1e-3, atol=1e-3 * float(np.abs(exact).max()))
            for rows in (np.arange(7, 19), np.arange(n - 300, n), rng.choice(n, 40, replace=False)):
                part = np.empty((tokens, len(rows)), np.float32)
                nbits.matmul(weight(codes[rows], scales[rows], offsets[rows]), x, part)
                np.testing.assert_array_equal(part, half[:, rows])


def test_only_a_device_that_can_lack_groups_loads_them_ahead(stories_weights):
    """Where every candidate group was built at the start and stays (unbounded), a prediction starts no load on the
    background thread (it found nothing to load, and took the GIL from the computation waiting for partial sums);
    nor where a bounded cache has room for every candidate and holds them; a bounded cache that lacks some, and fp32
    weights (their pages advised in), still load the next layer ahead."""
    c = stories_weights.config
    layout = GroupLayout.for_model(c)
    ranges = {l: (0, 3) for l in range(c.n_layers)}

    class Ranker:  # predictors that rank the groups in reverse order
        sessions = {l: None for l in range(1, c.n_layers)}

        def rank(self, layer, hidden):
            n = len(hidden)
            return (np.tile(np.arange(c.n_heads), (n, 1)), np.tile(np.arange(layout.n_mlp_groups)[::-1], (n, 1)))

    x = np.random.default_rng(0).standard_normal((1, c.dim)).astype(np.float32)
    unbounded = Remapper(stories_weights, layout, ranges, Ranker(), fmt="int8")
    group_bytes = unbounded.cache.held_bytes // len(unbounded.cache)
    bounded = Remapper(stories_weights, layout, ranges, Ranker(), fmt="int8", cache_bytes=8 * group_bytes)
    roomy = Remapper(stories_weights, layout, ranges, Ranker(), fmt="int8", cache_bytes=unbounded.cache.held_bytes)
    fp32 = Remapper(stories_weights, layout, ranges, Ranker(), fmt="fp32")
    assert len(roomy.cache) == len(unbounded.cache) and roomy.cache.capacity_bytes is not None
    for remapper, loads in ((unbounded, False), (roomy, False), (bounded, True), (fp32, True)):
        remapper.begin()
        remapper.predict(1, x)
        assert remapper.loads == loads and (1 in remapper.loading) == loads
        partial = remapper.mlp_partial(1, x)  # computes the predicted groups either way
        assert partial.shape == (1, c.dim) and np.abs(partial).sum() > 0
        remapper.close()


def test_groups_stay_on_their_device_within_a_tier_of_equally_reliable_ones():
    """keep_in_place: between devices whose links lose alike, a group that stays in their tier of ranks stays on the
    device that computed it last token; groups new to the tier fill the places left, most important first; ranks
    outside the tier (the master's top ones, a less reliable device's) are the ranking's. Over a run of rankings that
    change a little each token, the devices of a tier read far fewer groups than with the ranking as predicted."""
    from halo.compute.remap import keep_in_place

    tier = [(2, 4), (4, 6), (6, 8)]  # the master holds ranks 0-1, three equally reliable agents 2 each, one more
    previous = np.array([7, 6, 0, 1, 2, 3, 4, 5, 8, 9])
    row = np.array([0, 7, 4, 2, 6, 9, 1, 3, 5, 8])  # 6 and 0 swap tier and master; 9 enters from the last device's
    placed = keep_in_place(row, previous, [tier])
    assert placed[:2].tolist() == [0, 7] and placed[8:].tolist() == [5, 8]  # outside the tier: as ranked
    assert placed[2:4].tolist() == [1, 6] and placed[4:6].tolist() == [2, 3] and placed[6:8].tolist() == [4, 9]
    assert sorted(placed.tolist()) == list(range(10))
    assert keep_in_place(row, None, [tier]) is row and keep_in_place(row, previous, []) is row

    rng = np.random.default_rng(0)
    ranking = rng.permutation(16)
    raw_moves = kept_moves = 0
    last_raw = last_kept = None
    for _ in range(200):
        i, j = rng.integers(0, 16, 2)  # the predictors' ranking drifts: two groups swap ranks each token
        ranking[[i, j]] = ranking[[j, i]]
        placed = keep_in_place(ranking, last_kept, [[(4, 8), (8, 12), (12, 16)]])
        if last_raw is not None:
            raw_moves += sum(len(set(ranking[a:b]) - set(last_raw[a:b])) for a, b in [(4, 8), (8, 12), (12, 16)])
            kept_moves += sum(len(set(placed[a:b]) - set(last_kept[a:b])) for a, b in [(4, 8), (8, 12), (12, 16)])
        assert set(placed[:4]) == set(ranking[:4]) and sorted(placed.tolist()) == list(range(16))
        last_raw, last_kept = ranking.copy(), placed
    assert kept_moves < 0.5 * raw_moves, (kept_moves, raw_moves)


def test_tiers_join_consecutive_agents_that_lose_alike_are_alike_critical_and_take_the_masters_ranking():
    """The master's tiers for keep_in_place: consecutive agent rank ranges whose probed loss is within TIER_PLR, on the
    same side of the critical cut (a top group must not move to an agent whose partial may be zero-filled: a range the
    cut crosses joins with its lower part), with an agent that reads groups from storage; none over TCP or where an
    agent ranks the layer itself (a listener)."""
    from types import SimpleNamespace

    from halo.compute.shares import Block
    from halo.distributed.master import DistributedModel
    from halo.sync import SyncSettings

    def agent(a, b, plr, loads=True):
        return SimpleNamespace(share=SimpleNamespace(mlp=[[], list(range(a, b))]), loads_ahead=loads,
                               profile={"link": {"plr": plr}})

    agents = {1: agent(2, 4, 0.0), 2: agent(4, 6, 0.01), 3: agent(6, 7, 0.0), 4: agent(7, 8, 0.08)}
    fake = SimpleNamespace(sync=SyncSettings(mode="halo", critical_fraction=0.5), listeners={}, agents=agents,
                           holders={Block("mlp", 1): [1, 2, 3, 4]}, layout=SimpleNamespace(n_mlp_groups=8))
    assert DistributedModel._tiers(fake, 1) == [[(4, 6), (6, 7)]]  # 1 is critical (ranks < 4), 4 loses more
    fake.sync = SyncSettings(mode="halo", critical_fraction=0.375)  # the cut at rank 3, inside agent 1's ranks
    assert DistributedModel._tiers(fake, 1) == [[(3, 4), (4, 6), (6, 7)]]  # its rank 2 stays where it is ranked
    fake.sync = SyncSettings(mode="halo", critical_fraction=0.25)
    assert DistributedModel._tiers(fake, 1) == [[(2, 4), (4, 6), (6, 7)]]
    agents[2].loads_ahead = agents[1].loads_ahead = agents[3].loads_ahead = False
    assert DistributedModel._tiers(fake, 1) == []  # nobody reads groups: nothing to keep in place
    agents[2].loads_ahead = True
    fake.listeners = {1: [2]}
    assert DistributedModel._tiers(fake, 1) == []
    fake.listeners, fake.sync = {}, SyncSettings(mode="halo-tcp", critical_fraction=0.25)
    assert DistributedModel._tiers(fake, 1) == []


def test_over_lossless_links_a_layers_groups_stay_put_and_an_agent_given_a_top_group_is_critical():
    """Where every agent's probed link lost nothing, the ranking's placement protects nothing: one tier holds every
    rank range, the master's too, so keep_in_place keeps every group where it was (a bounded agent reads none), and
    the agents critical for a round are those placed a group the predictors ranked in the top (not those holding the
    top ranks' places); a lossy link brings the cut back."""
    from types import SimpleNamespace

    from halo.compute.shares import Block
    from halo.distributed.master import DistributedModel
    from halo.sync import SyncSettings

    def agent(a, b, plr):
        groups = list(range(a, b))
        return SimpleNamespace(share=SimpleNamespace(mlp=[[], groups], groups=lambda block: groups), loads_ahead=True,
                               profile={"link": {"plr": plr}})

    agents = {1: agent(2, 4, 0.0), 2: agent(4, 6, 0.0), 3: agent(6, 8, 0.0)}
    mlp = Block("mlp", 1)
    loaded = []  # the rankings the master's load thread would read its groups of (place runs before it)
    predicted = iter([np.arange(8)[None], np.array([[5, 2, 0, 1, 3, 4, 6, 7]]), np.tile(np.arange(8), (3, 1))])

    def predict_next(block, x, place=None):
        loaded.append(place(next(predicted)))

    worker = SimpleNamespace(share=SimpleNamespace(mlp=[[], [0, 1]]), remapper=object(), loads_ahead=False,
                             predict_next=predict_next)
    fake = SimpleNamespace(sync=SyncSettings(mode="halo", critical_fraction=0.25), listeners={}, agents=agents,
                           holders={mlp: [1, 2, 3]}, layout=SimpleNamespace(n_mlp_groups=8), worker=worker,
                           rank_of={}, placed={})
    fake._ranks_of = lambda a, block: DistributedModel._ranks_of(fake, a, block)
    fake._place = lambda layer, ranking: DistributedModel._place(fake, layer, ranking)
    fake.tiers = {1: DistributedModel._tiers(fake, 1)}
    assert fake.tiers[1] == [[(0, 2), (2, 4), (4, 6), (6, 8)]]
    attention = Block("attention", 0)
    DistributedModel._predict_next(fake, attention, None)  # first token: placed as predicted
    DistributedModel._predict_next(fake, attention, None)  # groups 5 and 2 rank top (cut: 2 ranks)
    assert loaded[1].tolist() == [list(range(8))]  # nothing moves
    assert DistributedModel._critical(fake, mlp, [1, 2, 3]) == {1, 2}  # they hold groups 2 and 5
    assert DistributedModel._ranks_of(fake, agents[3], mlp) == [6, 7]
    DistributedModel._predict_next(fake, attention, None)  # a prompt's rows: as predicted, the top places critical
    assert loaded[2].shape == (3, 8) and DistributedModel._critical(fake, mlp, [1, 2, 3]) == set()
    agents[3].profile["link"]["plr"] = 0.04
    assert DistributedModel._tiers(fake, 1) == [[(2, 4), (4, 6)]]  # lossy: cut at the top, agent 3 a tier alone
    del agents[3].profile["link"]
    assert DistributedModel._tiers(fake, 1) == [[(2, 4), (4, 6), (6, 8)]]  # never probed: not known lossless, the cut


def test_memory_an_earlier_session_frees_while_shards_build_is_not_given_to_the_groups(stories_weights, monkeypatch):
    """The groups' budget is the device's budget less what its other shards made the process grow by. Heap an earlier
    session left, freed while they build, makes that growth negative: it must not raise the budget past what was
    given (the master once held its groups as kernels under a budget that holds only compact ones)."""
    import halo.compute.worker as worker_module
    from halo.compute.shares import Shares
    from halo.compute.worker import DeviceWorker

    layout = GroupLayout.for_model(stories_weights.config)
    n = stories_weights.config.n_layers
    share = Shares(attention=[[] for _ in range(n)], mlp=[list(range(layout.n_mlp_groups)) for _ in range(n)],
                   lm_head=[])
    shrinking = iter([50_000_000] + [10_000_000] * 1000)  # at the start, then 40 MB freed by someone else
    monkeypatch.setattr(worker_module, "resident_bytes", lambda: next(shrinking))
    monkeypatch.setattr(worker_module, "groups_headroom", lambda: None)
    worker = DeviceWorker(stories_weights, layout, share, 32, "int8", remap=True, memory_budget=400_000)
    report = worker.remapper.report()["group_cache"]
    assert worker.remapper.resident_budget <= 400_000, report
    assert report["capacity_bytes"] is not None and report["kernel"] == COMPACT_KERNEL, report
