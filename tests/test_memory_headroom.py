"""What a process under a cgroup memory limit may still take (halo/host/memory.py): the limit less what its cgroup is
charged for and holds in use, not less its resident set (which also counts pages other cgroups were charged for)."""

import subprocess
import sys

import pytest

import halo.host.memory as memory

MB = 1 << 20


@pytest.mark.parametrize("version", [1, 2])
def test_headroom_is_the_limit_less_what_the_cgroup_holds_in_use(tmp_path, monkeypatch, version):
    """anon + shared memory + mapped file pages of the cgroup's own charge; the clean page cache it read through and
    the resident set's pages charged elsewhere do not count."""
    if version == 1:
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_rss", "total_shmem", "total_mapped_file"))
        kernel = ()
        stat = {"cache": 90 * MB, "rss": 1, "total_cache": 90 * MB, "total_rss": 30 * MB, "total_shmem": 2 * MB,
                "total_mapped_file": 8 * MB}
    else:  # (v2 also counts the kernel memory reclaim cannot free; a field an older kernel lacks counts 0)
        files = ("memory.max", "memory.current", ("anon", "shmem", "file_mapped"))
        kernel = ("pagetables", "sock", "slab_unreclaimable")
        stat = {"file": 90 * MB, "anon": 29 * MB, "shmem": 2 * MB, "file_mapped": 8 * MB, "pagetables": MB // 2,
                "slab_unreclaimable": MB // 2}
    (tmp_path / files[0]).write_text(str(200 * MB))
    (tmp_path / files[1]).write_text(str(130 * MB))
    (tmp_path / "memory.stat").write_text("".join(f"{k} {v}\n" for k, v in stat.items()))
    monkeypatch.setattr(memory, "memory_cgroup", lambda: memory.MemoryCgroup(tmp_path, *files, kernel))
    monkeypatch.setattr(memory, "resident_bytes", lambda: 150 * MB)  # (what the old headroom subtracted)
    assert memory.memory_limit() == (200 * MB, 130 * MB)
    assert memory.charged_bytes() == 40 * MB
    assert memory.memory_headroom(0.1, 1) == 200 * MB - 40 * MB - 20 * MB
    (tmp_path / "memory.stat").write_text("nothing 1\n")  # a stat without the fields: the resident set, as before
    assert memory.memory_headroom(0.1, 1) == 200 * MB - 150 * MB - 20 * MB


@pytest.mark.parametrize("cap, found", [("1073741824", True), ("max", False)])
def test_a_containers_own_root_group_is_its_limit_the_machines_is_not(tmp_path, monkeypatch, cap, found):
    """In a container's cgroup namespace (v2) a process sits at "/" and the root's memory.max is the container's
    limit: it counts (an agent in Docker budgets from it). The machine's own root (no limit) is everyone's memory."""
    (tmp_path / "memory.max").write_text(cap)
    (tmp_path / "memory.current").write_text(str(100 * MB))
    (tmp_path / "memory.stat").write_text(f"anon {50 * MB}\nshmem 0\nfile_mapped {10 * MB}\n")
    monkeypatch.setattr(memory, "CGROUP_V2", tmp_path)
    monkeypatch.setattr(memory, "cgroups", lambda: [([""], "/")])
    assert (memory.memory_cgroup() is not None) == found
    assert memory.memory_limit() == ((1 << 30, 100 * MB) if found else None)
    if found:
        assert memory.charged_bytes() == 60 * MB


def test_pages_charged_to_another_cgroup_leave_a_limited_process_its_headroom(tmp_path):
    """A real cgroup: the child maps and reads a 64 MB file whose pages the parent's cgroup was charged for (as an
    agent maps Python's and onnxruntime's code, already loaded by others): its resident set grows by 64 MB, its
    headroom does not shrink; 32 MB of its own anonymous memory do shrink it."""
    from halo.rpi.limits import DeviceLimits, read_into_cache, available as limits_available

    ok, why = limits_available()
    if not ok:
        pytest.skip(f"memory cgroups unavailable: {why}")
    data = tmp_path / "weights.bin"
    data.write_bytes(b"\1" * (64 * MB))
    read_into_cache(data)
    code = ("import mmap, sys; import numpy as np; from halo.host.memory import memory_headroom, resident_bytes\n"
            "def show(): print(resident_bytes() >> 20, memory_headroom(0.0, 0) >> 20, flush=True)\n"
            "show(); f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
            "a = np.frombuffer(m, np.uint8); int(a[::4096].sum()); show()\n"
            "b = np.ones(32 << 20, np.uint8); show()\n")
    with DeviceLimits("halo-test-headroom", 256 * MB) as limits:
        out = subprocess.run([sys.executable, "-c", code, str(data)], preexec_fn=limits.join, capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (rss0, room0), (rss1, room1), (rss2, room2) = (map(int, line.split()) for line in out.stdout.split("\n")[:3])
    assert rss1 - rss0 >= 60, out.stdout  # the mapped file is resident...
    assert room0 - room1 <= 4, out.stdout  # ...and charged to the parent's cgroup: the headroom stays
    assert 30 <= room1 - room2 <= 36, out.stdout  # the process's own memory counts


def test_one_process_under_a_limit_too_small_for_the_model_refuses_with_the_numbers(stories_weights, monkeypatch):
    """The single-process model under a cgroup limit that cannot hold it says so before loading (what it needs, what
    the cgroup leaves, what to do) instead of being killed halfway; within the limit, or with none, it loads."""
    from halo.compute.transformer import Transformer
    from halo.errors import ConfigError

    monkeypatch.setattr(memory, "memory_limit", lambda: (2 * MB, 2 * MB))  # usage at the limit: page cache too
    monkeypatch.setattr(memory, "charged_bytes", lambda: MB + MB // 2)  # 0.5 MB left of what reclaim cannot free
    with pytest.raises(ConfigError, match=r"the model needs [1-9][\d.]* MB \(weights [\d.]+ MB in fp32, KV cache [\d.]+ MB "
                                          r"for 64 positions x 1 slot\(s\)\) but this process's memory cgroup leaves 0\.5 MB of its 2\.1 MB: run it across devices \(--agents"):
        Transformer(stories_weights, fmt="fp32", max_seq_len=64)
    monkeypatch.setattr(memory, "memory_limit", lambda: (64 * MB, 64 * MB))  # full of page cache: it loads
    assert Transformer(stories_weights, fmt="fp32", max_seq_len=64).forward([1]).shape == (512,)
    monkeypatch.setattr(memory, "memory_limit", lambda: None)
    Transformer(stories_weights, fmt="fp32", max_seq_len=64)
