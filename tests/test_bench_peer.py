"""The peer benchmark's own parts, without the peer: its files hold halo's weights, and its timing reads a
token's wall time from the peer's per-token lines."""

from __future__ import annotations

import argparse
import stat
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from halo.eval import bench_peer
from halo.eval.dllama_files import write_model, write_tokenizer
from halo.eval.random_checkpoint import TINYLLAMA_1_1B, write_random_gguf

SMALL = {**TINYLLAMA_1_1B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 160, "max_position_embeddings": 64}
# a layer's tensors in the order the peer reads them (its src/llm.cpp), by their names in halo's GGUF
PEER_LAYER = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_down", "ffn_up", "attn_norm", "ffn_norm")


@pytest.mark.parametrize("streamed", [False, True])
def test_the_peer_model_holds_the_blocks_of_halos_gguf_in_the_peers_order(tmp_path, monkeypatch, streamed):
    """streamed: both written a run of rows at a time (the Llama-3.1-8B shape's way), runs of 32 rows here."""
    gguf = pytest.importorskip("gguf")
    from halo.eval import random_checkpoint

    monkeypatch.setattr(random_checkpoint.RowChunks, "ROWS", 32)
    model = write_model(tmp_path / "m.m", SMALL, streamed=streamed)
    write_random_gguf(tmp_path / "m.gguf", SMALL, "Q4_0", streamed=streamed)
    ours = {t.name: bytes(np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    raw = model.read_bytes()
    magic, header = struct.unpack_from("<ii", raw)
    assert magic == 0x0A00ABCD
    pairs = dict(struct.iter_unpack("<ii", raw[8:header]))
    assert pairs[2] == 128 and pairs[3] == 256 and pairs[4] == 2 and pairs[13] == 2  # dim, hidden, layers, Q40
    d, v = SMALL["hidden_size"], SMALL["vocab_size"]
    at = header + 4 * v * d  # the embedding is float32 in the peer's file
    for layer in range(2):
        for part in PEER_LAYER:
            block = ours[f"blk.{layer}.{part}.weight"]
            assert raw[at:at + len(block)] == block, (layer, part)
            at += len(block)
    at += 4 * d  # the final norm
    assert raw[at:] == ours["output.weight"]  # the LM head, and nothing after it


def test_the_peer_tokenizer_covers_printable_ascii(tmp_path):
    path = write_tokenizer(tmp_path / "t.t", 160)
    raw = path.read_bytes()
    magic, header = struct.unpack_from("<ii", raw)
    assert magic == 0x567124
    pairs = dict(struct.iter_unpack("<ii", raw[8:header]))
    assert pairs[0] == 1 and pairs[1] == 160 and pairs[3] == 1  # version, vocab, bos
    at, tokens = header + 4, []  # after the one end-of-sequence id
    while at < len(raw):
        _, n = struct.unpack_from("<fI", raw, at)
        tokens.append(raw[at + 8:at + 8 + n])
        at += 8 + n
    assert len(tokens) == 160 and all(bytes([c]) in tokens for c in b"hello, world")


class Bed:
    """The test bed's popen, without namespaces."""

    def popen(self, host, argv, **kwargs):
        return subprocess.Popen(argv, **kwargs)


def fake_peer(tmp_path, ms: list[int]):
    """A stand-in for the peer's root: loads, then one token line every ms[i] milliseconds, as it prints them."""
    script = tmp_path / "dllama"
    script.write_text(f"#!{sys.executable}\nimport time\nprint('loading...', flush=True)\n"
                      f"for ms in {ms!r}:\n    time.sleep(ms / 1000)\n"
                      "    print(f'\\U0001F536 Pred{ms - 2:5d} ms Sync    2 ms | Sent     1 kB Recv     1 kB | x', flush=True)\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_peer_tokens_time_is_the_wall_time_between_its_lines_after_the_warm_up(tmp_path):
    ms = [200] * (1 + bench_peer.WARMUP) + [20, 40, 20, 40, 20, 40, 20, 40, 20, 40]
    result = bench_peer.run_peer(Bed(), fake_peer(tmp_path, ms), tmp_path / "m", tmp_path / "t", [], "0", 10, 60.0)
    assert len(result["ms_per_token"]) == 10  # the first line (it waited for the prompt) and the warm-up left out
    assert 25 < np.mean(result["ms_per_token"]) < 60
    assert result["reported_ms"] == ms[1 + bench_peer.WARMUP:]


def test_a_slow_peer_is_stopped_at_the_time_limit(tmp_path):
    ms = [10] * (1 + bench_peer.WARMUP) + [150] * 40
    result = bench_peer.run_peer(Bed(), fake_peer(tmp_path, ms), tmp_path / "m", tmp_path / "t", [], "0", 40, 1.0)
    assert 8 <= len(result["ms_per_token"]) < 20  # at least 8 timed tokens, then it stops past a second


def test_a_peer_that_generates_nothing_says_what_it_printed(tmp_path):
    script = tmp_path / "dllama"
    script.write_text(f"#!{sys.executable}\nprint('Unsupported header key')\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="Unsupported header key"):
        bench_peer.run_peer(Bed(), script, tmp_path / "m", tmp_path / "t", [], "0", 8, 5.0)


def test_a_vocabulary_too_small_for_the_prompt_characters_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot hold"):
        write_tokenizer(tmp_path / "t.t", 64)


def arguments(**changes):
    args = dict(agents=3, modes="exact,halo", plr="0,0.05", tokens=32, dllama="dllama", llamacpp=None)
    return argparse.Namespace(**{**args, **changes})


@pytest.mark.parametrize("changes, says", [
    (dict(agents=2), "must divide 4"), (dict(modes="exact,fast"), "unknown halo sync mode"),
    (dict(plr="0,5"), r"\[0, 1\)"), (dict(plr="none"), "fractions"), (dict(tokens=500), "between 8 and"),
    (dict(dllama=None), "name a peer"), (dict(dllama=None, llamacpp="x", agents=0), "at least 1"),
    (dict(modes="exact,exact@twice"), "which --variants does not define")])
def test_what_the_peer_or_the_bench_cannot_run_is_refused_before_anything_starts(changes, says):
    bench_peer.check_arguments(arguments())  # the defaults pass
    bench_peer.check_arguments(arguments(modes="exact,exact@twice", variants='{"twice": {"copies": 2}}'))
    with pytest.raises(SystemExit, match=says):
        bench_peer.check_arguments(arguments(**changes))


def test_the_report_compares_the_fastest_of_each_system_at_every_loss_rate():
    rows = [{"plr": 0.0, "sync": "halo single process", "system": "halo", "ms_mean": 20.0},
            {"plr": 0.0, "sync": "dllama single process", "system": "dllama", "ms_mean": 60.0},
            *({"plr": plr, "sync": sync, "system": system, "ms_mean": ms} for plr, sync, system, ms in [
                (0.0, "exact", "halo", 30.0), (0.0, "halo", "halo", 40.0), (0.0, "dllama", "dllama", 45.0),
                (0.0, "dllama turbo", "dllama", 180.0), (0.05, "exact", "halo", 36.0), (0.05, "halo", "halo", 44.0),
                (0.05, "dllama", "dllama", 1800.0), (0.05, "dllama turbo", "dllama", 1440.0)])]
    args = argparse.Namespace(argv=[], agents=3, layers=22, tokens=32, plan="even-mlp-only", runs=1, profile=None)
    text = "\n".join(bench_peer.render(rows, ["exact", "halo"], args))
    assert "| 0 % | 30.0 | 40.0 | 45.0 | 180.0 | 1.50x |" in text
    assert "| 5 % | 36.0 | 44.0 | 1800.0 | 1440.0 | 40.00x |" in text  # the peer's default was its faster there
    assert "exact 1.50x, halo 2.00x, dllama 0.75x" in text  # at 0 % against each system's own single process
    assert "exact 1.20x" in text  # at 5 % against its own 0 %
    # a peer that timed no token is said so, and the ratio takes its other mode (it crashed the run before)
    timed = [r for r in rows if not (r["plr"] == 0.05 and r["sync"] == "dllama turbo")]
    stalled = [{"sync": "dllama turbo", "plr": 0.05, "run": 0, "why": "no timed token within 300 s (0 lines)"}]
    text = "\n".join(bench_peer.render(timed, ["exact", "halo"], replace_profile(args, "wifi-busy"), stalled))
    assert "| 5 % | 36.0 | 44.0 | 1800.0 | no timed token within 300 s (0 lines) | 50.00x |" in text
    assert "every agent link emulated as `wifi-busy` (5 +- 3 ms one way, 5 % lost in bursts of ~5" in text


def replace_profile(args, profile):
    return argparse.Namespace(**{**vars(args), "profile": profile})


def fake_llama_bench(tmp_path, body: str):
    """A stand-in for llama-bench (and an rpc-server beside it) in a bin directory of its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, text in (("llama-bench", body), ("rpc-server", "import time\ntime.sleep(60)\n")):
        script = bin_dir / tool
        script.write_text(f"#!{sys.executable}\nimport json, sys, time\n{text}")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_llama_cpps_token_time_is_its_own_timing_of_the_generated_tokens_and_it_is_given_the_servers(tmp_path):
    bin_dir = fake_llama_bench(tmp_path, "print(json.dumps([{'n_gen': 16, 'samples_ns': [320_000_000], "
                                         "'backends': 'RPC', 'argv': sys.argv[1:]}]))\n")
    result = bench_peer.run_llamacpp(Bed(), bin_dir, tmp_path / "m.gguf", ["10.0.0.1:50052", "10.0.0.2:50052"], 16,
                                     30.0)
    assert result["tokens"] == 16 and result["ms_mean"] == pytest.approx(20.0) and result["backends"] == "RPC"
    alone = bench_peer.run_llamacpp(Bed(), bin_dir, tmp_path / "m.gguf", [], 16, 30.0)
    assert alone["ms_mean"] == pytest.approx(20.0)


def test_a_llama_cpp_run_that_fails_or_hangs_is_stalled_with_what_it_said(tmp_path):
    failing = fake_llama_bench(tmp_path, "print('failed to connect to 10.0.0.2:50052', file=sys.stderr)\nsys.exit(1)\n")
    with pytest.raises(bench_peer.PeerStalled, match="failed to connect") as failed:
        bench_peer.run_llamacpp(Bed(), failing, tmp_path / "m.gguf", ["10.0.0.2:50052"], 16, 30.0)
    assert failed.value.short == "failed (exit 1)"
    hanging = fake_llama_bench(tmp_path, "time.sleep(30)\n")
    started = time.monotonic()
    with pytest.raises(bench_peer.PeerStalled) as hung:
        bench_peer.run_llamacpp(Bed(), hanging, tmp_path / "m.gguf", ["10.0.0.2:50052"], 16, 1.0)
    assert hung.value.short == "no result within 1 s" and time.monotonic() - started < 15


def test_the_report_puts_llama_cpp_beside_the_others_with_its_ratio_to_halo():
    rows = [{"plr": 0.0, "sync": sync, "system": system, "ms_mean": ms} for sync, system, ms in [
        ("halo single process", "halo", 20.0), ("dllama single process", "dllama", 60.0),
        ("llama.cpp single process", "llama.cpp", 25.0), ("exact", "halo", 30.0), ("halo", "halo", 40.0),
        ("dllama", "dllama", 45.0), ("dllama turbo", "dllama", 180.0), ("llama.cpp rpc", "llama.cpp", 75.0)]]
    args = argparse.Namespace(argv=[], agents=3, layers=8, tokens=16, plan="even-mlp-only", runs=1, profile=None)
    text = "\n".join(bench_peer.render(rows, ["exact", "halo"], args))
    assert "| PLR | exact ms | halo ms | dllama ms | dllama turbo ms | llama.cpp rpc ms |" in text
    assert "| 0 % | 30.0 | 40.0 | 45.0 | 180.0 | 75.0 | 1.50x | 2.50x |" in text
    assert "Alone (no network): halo 20.0 ms, distributed-llama 60.0 ms, llama.cpp 25.0 ms per token." in text
    assert "llama.cpp rpc 3.00x" in text  # against llama.cpp's own single process
    alone = [r for r in rows if r["system"] != "dllama"]  # a run without distributed-llama: no columns of it
    text = "\n".join(bench_peer.render(alone, ["exact", "halo"], args))
    assert "| PLR | exact ms | halo ms | llama.cpp rpc ms | llama.cpp rpc / fastest halo |" in text
    assert "| 0 % | 30.0 | 40.0 | 75.0 | 2.50x |" in text
    stalled = [{"sync": "llama.cpp rpc", "plr": 0.0, "run": 0, "why": "no result within 660 s"}]
    text = "\n".join(bench_peer.render(rows[:-1], ["exact", "halo"], args, stalled))
    assert "| 0 % | 30.0 | 40.0 | 45.0 | 180.0 | no result within 660 s | 1.50x | - |" in text


def test_a_llama_cpp_directory_without_its_tools_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(SystemExit, match="no rpc-server or llama-bench there"):
        bench_peer.check_arguments(arguments(llamacpp=str(tmp_path)))
    bench_peer.check_arguments(arguments(llamacpp=str(fake_llama_bench(tmp_path, ""))))
    # llama.cpp alone: any number of agents (distributed-llama's KV-head rule is its own)
    bench_peer.check_arguments(arguments(dllama=None, agents=2, llamacpp=str(fake_llama_bench(tmp_path, ""))))
