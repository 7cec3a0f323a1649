"""What tensor parallelism can gain on this machine at all: the floor under halo's rounds, measured.

    python -m halo.eval.bench_round_floor [--model tinyllama-q4] [--agents 1,2,3] [--tokens 32] [--runs 3]

Two measurements, with halo's own C kernels and nothing of its runtime:
1. Shared memory bandwidth. A decode step streams every weight once: it is bound by memory bandwidth, not
   arithmetic. Half of every layer's MLP runs alone, then in two processes at once (each its own half, as two
   TP devices would): on a machine whose cores have a memory bus each, both keep their solo speed; here both
   share one, and the slowdown caps what two cores can gain on any bandwidth-bound step.
2. A minimal TP decode. Master + N agents on loopback, the plan of the speed benchmarks (`even-mlp-only`: the
   attention and LM head on the master, the MLP in equal shares), each round the bare minimum: the master
   sends the residual stream as raw float32 datagrams, every device runs its share in one C call, the agents
   send their partial sums back the same way, the master adds them. No authentication, framing, parity,
   NACKs, deadlines, statistics or event loop: what halo's rounds do for a lossy, hostile network costs time
   this floor leaves out. Against the same minimal loop in one process, against halo's single process, and
   beside halo's own cluster on the same loopback (`exact`, same plan) in the same run.
3. The same minimal decode with its rounds compiled (eval/round_floor.c, built here with the machine's C compiler:
   an agent's whole life and each of the master's MLP rounds one C call): what a round costs when none of it is
   interpreted. Skipped, and said so, where no compiler or kernel source is at hand.

Greedy from the speed benchmark's prompt; the tokens of every row must be the single process's (the run
fails otherwise). Writes eval/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from halo.eval.bench_churn import add_model_argument, model_file
from halo.eval.bench_halo_speed import decode, median_runs
from halo.eval.report import command_line, run_script, write_report

CONTEXT = 256
FLOATS_PER_DATAGRAM = 350  # 1,400 bytes of payload: one Ethernet frame, as halo's chunks
HEADER = 6  # round number (4 bytes) and chunk index (2)
AGENT_WAIT_S = 120.0  # an agent whose master went quiet this long exits (a master killed mid-run)
STOP_ROUND = 0xFFFFFFFF  # a datagram of this round number ends an agent


class Stopped(Exception):
    """The master said stop (STOP_ROUND)."""


# ---- raw datagrams --------------------------------------------------------------------------------------
def send_vector(sock: socket.socket, to, round_no: int, vector: np.ndarray) -> None:
    data = vector.astype(np.float32, copy=False).tobytes()
    step = 4 * FLOATS_PER_DATAGRAM
    for index, start in enumerate(range(0, len(data), step)):
        sock.sendto(round_no.to_bytes(4, "little") + index.to_bytes(2, "little") + data[start:start + step], to)


def receive_vectors(sock: socket.socket, round_no: int, into: dict, timeout_s: float) -> None:
    """Fill into[sender address] (float32 [D]) with that sender's vector of round_no; datagrams of other rounds
    (none on loopback without loss) are skipped. Raises Stopped on a STOP_ROUND datagram from one of them."""
    width = next(iter(into.values())).size
    waiting = -(-width // FLOATS_PER_DATAGRAM) * len(into)
    buffer = bytearray(HEADER + 4 * FLOATS_PER_DATAGRAM)
    sock.settimeout(timeout_s)
    while waiting:
        size, sender = sock.recvfrom_into(buffer)
        got = int.from_bytes(buffer[:4], "little")
        if got == STOP_ROUND and sender in into:
            raise Stopped
        if got != round_no or sender not in into:
            continue
        start = int.from_bytes(buffer[4:6], "little") * FLOATS_PER_DATAGRAM
        count = (size - HEADER) // 4
        into[sender][start:start + count] = np.frombuffer(buffer, np.float32, count, HEADER)
        waiting -= 1


def in_child(work) -> None:
    """A forked child's whole life: work(), its traceback on stderr if it fails, then exit (never return into the
    parent's code)."""
    code = 1
    try:
        work()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
    return sock


# ---- the minimal TP model -------------------------------------------------------------------------------
def mlp_shares(n_groups: int, nodes: int) -> list[list[int]]:
    """Equal contiguous MLP shares, the master's first."""
    return [list(range(i * n_groups // nodes, (i + 1) * n_groups // nodes)) for i in range(nodes)]


class MinimalTensorParallel:
    """halo's decode arithmetic over `agents` forked agents and raw loopback datagrams (agents=0: one process).
    A forward pass of T tokens runs T decode steps (only decode steps are timed)."""

    def __init__(self, weights, agents: int, timeout_s: float = 30.0):
        from halo.compute.neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
        from halo.model.ops import Rotary

        self.weights, self.config, self.timeout_s = weights, weights.config, timeout_s
        layout = GroupLayout.for_model(self.config)
        shares = mlp_shares(layout.n_mlp_groups, agents + 1)
        layers = range(self.config.n_layers)
        self.socks = [udp_socket() for _ in range(agents + 1)]
        self.addresses = [s.getsockname() for s in self.socks]
        self.pids, self.round_no, self.pos = [], 0, 0
        try:
            for i in range(1, agents + 1):
                pid = os.fork()
                if pid == 0:  # the agent: builds its share, serves rounds until told to stop, never returns
                    in_child(lambda i=i: self._serve([MlpShard(weights.layers[l], layout, shares[i], fmt="native")
                                                      for l in layers], i))
                self.pids.append(pid)
            self.attention = [AttentionShard(weights.layers[l], layout, range(layout.n_heads), CONTEXT, fmt="native")
                              for l in layers]
            self.mlp = [MlpShard(weights.layers[l], layout, shares[0], fmt="native") for l in layers]
            self.lm_head = LmHeadShard(weights.lm_head, layout, range(layout.n_vocab_groups), fmt="native")
            self.rotary = Rotary(self.config, CONTEXT)
            self.partials = {a: np.empty(self.config.dim, np.float32) for a in self.addresses[1:]}
        except BaseException:
            self.close()  # the agents forked so far must not outlive us
            raise

    def _serve(self, mlp: list, i: int) -> None:
        """Round r is layer (r - 1) mod L: every decode step syncs each layer once, in order; until told to stop."""
        sock, master = self.socks[i], self.addresses[0]
        x = np.empty(self.config.dim, np.float32)
        eps, round_no = self.config.norm_eps, 0
        while True:
            round_no += 1
            try:
                receive_vectors(sock, round_no, {master: x}, AGENT_WAIT_S)
            except Stopped:
                return
            layer = (round_no - 1) % self.config.n_layers
            send_vector(sock, master, round_no, mlp[layer].step(x[None], self.weights.layers[layer].mlp_norm, eps)[0])

    def forward(self, tokens) -> np.ndarray:
        from halo.model.ops import rmsnorm
        from halo.model.quant import embed

        for token in tokens:
            x, eps = embed(self.weights.tok_embeddings, np.array([token])), self.config.norm_eps
            for l, layer in enumerate(self.weights.layers):
                x = x + self.attention[l].step(x, layer.attn_norm, eps, self.pos, self.rotary)
                x = x + self._mlp(l, x)
            self.pos += 1
        return self.lm_head.forward(rmsnorm(x, self.weights.final_norm, eps))[0]

    def _mlp(self, l: int, x: np.ndarray) -> np.ndarray:
        self.round_no += 1
        for address in self.addresses[1:]:
            send_vector(self.socks[0], address, self.round_no, x[0])
        out = self.mlp[l].step(x, self.weights.layers[l].mlp_norm, self.config.norm_eps)
        if self.pids:
            receive_vectors(self.socks[0], self.round_no, self.partials, self.timeout_s)
            for address in self.addresses[1:]:
                out = out + self.partials[address]
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for address in self.addresses[1:]:
            self.socks[0].sendto(STOP_ROUND.to_bytes(4, "little") + bytes(2), address)
        reap(self.pids)
        for sock in self.socks:
            sock.close()


def reap(pids: list[int]) -> None:
    """Wait for forked agents told to stop; one that has not within 10 s (it cannot miss a stop on loopback) is
    killed."""
    deadline = time.monotonic() + 10.0
    for pid in pids:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)


# ---- the compiled floor ---------------------------------------------------------------------------------
def build_compiled_floor(into: Path):
    """eval/round_floor.c built against the kernel's source (halo/_nbits.c) into `into`, loaded: the module, or why
    it cannot be here (no compiler, no source beside this file). A failed build raises: the kernel's internals it
    uses have changed, and round_floor.c must follow."""
    import importlib.machinery
    import importlib.util
    import shlex
    import shutil
    import subprocess
    import sysconfig

    here = Path(__file__).resolve().parent
    source = here / "round_floor.c"
    kernel = next((p for p in (here.parent / "halo" / "_nbits.c", here.parent / "_nbits.c") if p.exists()), None)
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not source.exists() or kernel is None:
        return (f"{source.name} or the kernel's source (_nbits.c) is missing beside {here} (the package ships both; "
                "reinstall it)")
    if shutil.which(compiler[0]) is None:
        return f"no C compiler ({compiler[0]}) on this machine"
    target = into / ("_round_floor" + sysconfig.get_config_var("EXT_SUFFIX"))
    command = [*compiler, "-O3", "-ffp-contract=off", "-fopenmp", "-Werror=implicit-function-declaration", "-shared",
               "-fPIC", f"-I{sysconfig.get_paths()['include']}", f"-I{kernel.parent}", str(source), "-o", str(target)]
    built = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if built.returncode != 0:
        raise RuntimeError(f"building {source} failed ({' '.join(command)}):\n{built.stderr[-2000:]}")
    loader = importlib.machinery.ExtensionFileLoader("_round_floor", str(target))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("_round_floor", loader))
    loader.exec_module(module)
    return module


def connected_pair(timeout_s: float, other_timeout_s: float) -> tuple[socket.socket, socket.socket]:
    """Two blocking loopback UDP sockets connected to each other (receives on each time out after its timeout)."""
    a, b = udp_socket(), udp_socket()
    for sock, other, timeout in ((a, b, timeout_s), (b, a, other_timeout_s)):
        if timeout <= 0:
            raise ValueError("socket timeouts must be positive (0 would block for ever)")
        sock.connect(other.getsockname())
        sock.setblocking(True)
        seconds = int(timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, int(1e6 * (timeout - seconds))))
    return a, b


class CompiledTensorParallel(MinimalTensorParallel):
    """MinimalTensorParallel with its rounds in C (`floor`: build_compiled_floor's module): each agent serves every
    round in one call; the master's attention and LM head as before, each MLP round one call."""

    def __init__(self, weights, agents: int, floor, timeout_s: float = 30.0):
        from halo.compute.neuron_groups import AttentionShard, GroupLayout, LmHeadShard, MlpShard
        from halo.model.ops import Rotary

        self.weights, self.config, self.floor = weights, weights.config, floor
        layout = GroupLayout.for_model(self.config)
        shares = mlp_shares(layout.n_mlp_groups, agents + 1)
        layers = range(self.config.n_layers)
        pairs, self.socks, self.pids, self.round_no, self.pos = [], [], [], 0, 0
        try:
            pairs += [connected_pair(timeout_s, AGENT_WAIT_S) for _ in range(agents)]
            self.socks = [mine for mine, _ in pairs]
            for i, (_, theirs) in enumerate(pairs, start=1):
                pid = os.fork()
                if pid == 0:  # the agent keeps its own socket only: a crashed sibling's port must not stay bound
                    for sock in [s for pair in pairs for s in pair if s is not theirs]:
                        sock.close()
                    in_child(lambda i=i, theirs=theirs: self._serve_compiled(
                        [MlpShard(weights.layers[l], layout, shares[i], fmt="native") for l in layers], theirs))
                self.pids.append(pid)
                theirs.close()
            self.attention = [AttentionShard(weights.layers[l], layout, range(layout.n_heads), CONTEXT, fmt="native")
                              for l in layers]
            self.mlp = [MlpShard(weights.layers[l], layout, shares[0], fmt="native") for l in layers]
            self.lm_head = LmHeadShard(weights.lm_head, layout, range(layout.n_vocab_groups), fmt="native")
            self.rotary = Rotary(self.config, CONTEXT)
            self.fds = tuple(sock.fileno() for sock in self.socks)
        except BaseException:
            self.close()
            for _, theirs in pairs:
                theirs.close()
            raise

    def _serve_compiled(self, mlp: list, sock: socket.socket) -> None:
        norms = [layer.mlp_norm for layer in self.weights.layers]
        result = self.floor.serve(sock.fileno(), [[shard.step_weights] for shard in mlp], norms, self.config.norm_eps,
                                  self.config.dim)
        if result == -2:
            raise MemoryError("a compiled agent ran out of memory")
        if result != 0:
            raise SystemExit("a compiled agent's rounds failed: its socket failed or its master went quiet for "
                             f"{AGENT_WAIT_S:.0f} s")

    def _mlp(self, l: int, x: np.ndarray) -> np.ndarray:
        self.round_no += 1
        y = np.empty((1, self.config.dim), np.float32)
        self.floor.round(self.fds, self.round_no, np.ascontiguousarray(x, np.float32), self.weights.layers[l].mlp_norm,
                         self.config.norm_eps, [self.mlp[l].step_weights], y)
        return y

    def close(self) -> None:
        for sock in self.socks:
            try:
                sock.send(STOP_ROUND.to_bytes(4, "little") + bytes(2))
            except OSError:
                pass  # that agent is gone already
        reap(self.pids)
        for sock in self.socks:
            sock.close()


# ---- shared memory bandwidth ----------------------------------------------------------------------------
def mlp_half_us(weights, seconds: float, together: bool) -> list[float]:
    """us per layer of half of every layer's MLP, each half in turn, or (together) both at once in two processes."""
    from halo.compute.neuron_groups import GroupLayout, MlpShard

    layout = GroupLayout.for_model(weights.config)
    halves = mlp_shares(layout.n_mlp_groups, 2)
    x = np.random.default_rng(0).standard_normal((1, weights.config.dim)).astype(np.float32)

    def loop(half: int, before_start=lambda: None) -> float:
        steps = [(MlpShard(layer, layout, halves[half], fmt="native"), layer) for layer in weights.layers]
        for shard, layer in steps:  # warm
            shard.step(x, layer.mlp_norm, weights.config.norm_eps)
        before_start()
        passes, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds:
            for shard, layer in steps:
                shard.step(x, layer.mlp_norm, weights.config.norm_eps)
            passes += 1
        return 1e6 * (time.perf_counter() - t) / (passes * len(steps))

    if not together:
        return [loop(0), loop(1)]
    (ready_r, ready_w), (go_r, go_w), (result_r, result_w) = os.pipe(), os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # both processes build their half, then start at once
        for fd in (ready_r, go_w, result_r):
            os.close(fd)
        in_child(lambda: os.write(result_w, repr(loop(1, lambda: (os.write(ready_w, b"r"), os.read(go_r, 1))))
                                  .encode()))
    for fd in (ready_w, go_r, result_w):  # ours closed: a child that dies reads as end of file, not a hang
        os.close(fd)
    try:
        def start_together():
            if not os.read(ready_r, 1):
                raise SystemExit("the bandwidth loop's second process failed (its traceback is above)")
            os.write(go_w, b"g")

        mine = loop(0, start_together)
        theirs = os.read(result_r, 64)
        if not theirs:
            raise SystemExit("the bandwidth loop's second process failed (its traceback is above)")
        return [mine, float(theirs)]
    finally:
        for fd in (ready_r, go_w, result_r):
            os.close(fd)
        os.waitpid(pid, 0)


@contextmanager
def halo_cluster(weights, path: Path, agents: int):
    """halo's master over `agents` local agents on loopback (exact, the even-mlp-only plan, one thread each)."""
    from halo.compute.neuron_groups import GroupLayout
    from halo.distributed import cluster_model
    from halo.runtime.local import LocalCluster
    from halo.scheduler.even import EVEN_PLANS, even_plan
    from halo.sync import SyncSettings

    plan = even_plan(weights, GroupLayout.for_model(weights.config), agents + 1, context=CONTEXT,
                     on_master=EVEN_PLANS["even-mlp-only"])
    with LocalCluster(agents, str(path), threads=1) as cluster:
        model = cluster_model(weights, cluster.endpoints, cluster.key, plan=plan, context=CONTEXT, timeout_s=60.0,
                              sync=SyncSettings(mode="exact"), fmt="native")
        try:
            yield model
        finally:
            model.close()


# ---- the benchmark --------------------------------------------------------------------------------------
def same_start(a: list, b: list) -> bool:
    """Whether two generations agree as far as both went (a run the time limit stopped early is shorter)."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def bench(args) -> dict:
    from halo.compute.transformer import Transformer
    from halo.model.loader import load_weights

    path = model_file(args.model)
    weights = load_weights(path)
    rows, reference = [], None

    def timed(name: str, model, run: int, agents: int = 0) -> None:
        """Decode with `model`: its row (sync: the setup, as median_runs groups rows)."""
        nonlocal reference
        result = decode(model, args.tokens, args.time_limit)
        if reference is None:
            reference = result["tokens"]
        elif not same_start(result["tokens"], reference):
            raise SystemExit(f"{name} generated other tokens than halo's single process: the minimal TP math is wrong")
        ms = result["ms_per_token"]
        rows.append({"agents": agents, "plr": 0.0, "sync": name, "run": run, "tokens": len(ms),
                     "ms_mean": float(np.mean(ms))})
        print(f"run {run + 1}/{args.runs}: {name}: {np.mean(ms):.1f} ms/token", flush=True)

    bandwidth = []
    with tempfile.TemporaryDirectory(prefix="halo-round-floor-") as build:
        floor = build_compiled_floor(Path(build))
        if isinstance(floor, str):
            print(f"no compiled rows: {floor}", flush=True)
        for run in range(args.runs):
            timed("halo single process", Transformer(weights, fmt="native", max_seq_len=CONTEXT), run)
            for agents in (0, *args.agents):
                with MinimalTensorParallel(weights, agents) as model:
                    timed(f"minimal, master + {agents}" if agents else "minimal, one process", model, run, agents)
            for agents in args.agents if not isinstance(floor, str) else ():
                with CompiledTensorParallel(weights, agents, floor) as model:
                    timed(f"compiled minimal, master + {agents}", model, run, agents)
            with halo_cluster(weights, path, max(args.agents)) as model:
                timed(f"halo exact, master + {max(args.agents)}", model, run, max(args.agents))
            alone, together = mlp_half_us(weights, args.seconds, False), mlp_half_us(weights, args.seconds, True)
            bandwidth.append({"run": run, "alone_us": alone, "together_us": together})
            print(f"run {run + 1}/{args.runs}: half MLP alone {np.mean(alone):.0f}, together {np.mean(together):.0f} "
                  "us/layer", flush=True)
    return {"command": command_line("halo.eval.bench_round_floor", args.argv), "model": str(path),
            "tokens": args.tokens, "runs": args.runs, "rows": rows, "bandwidth": bandwidth,
            "compiled": "built" if not isinstance(floor, str) else floor}


def render(result: dict) -> list[str]:
    medians = median_runs(result["rows"])
    ms = {row["sync"]: row["ms_mean"] for row in medians}
    runs = {row["sync"]: row["ms_mean_runs"] for row in medians}
    single, minimal = ms["halo single process"], ms["minimal, one process"]
    alone = float(np.median([np.mean(b["alone_us"]) for b in result["bandwidth"]]))
    together = float(np.median([np.mean(b["together_us"]) for b in result["bandwidth"]]))
    lines = [f"# The floor under a TP round on this machine ({Path(result['model']).name})", "",
             f"Command: `{result['command']}`. Greedy, {result['tokens']} tokens after the warm-up, one compute thread "
             f"per process, loopback; every row generated the single process's tokens. Each setup ran "
             f"{result['runs']} times, interleaved: a cell is the median run (every run in parentheses).", "",
             "## Shared memory bandwidth", "",
             "| half of every layer's MLP | us per layer |", "|---|---|",
             f"| alone | {alone:.0f} |", f"| two processes at once, each its own half | {together:.0f} |", "",
             f"Two cores stream a bandwidth-bound step {2 * alone / together:.2f}x as fast as one "
             f"(each runs {together / alone:.2f}x slower beside the other).", "",
             "## Minimal TP decode (raw datagrams, nothing of halo's runtime)", "",
             "| setup | ms per token | / minimal one process | / halo single process |", "|---|---|---|---|"]
    for setup, value in ms.items():
        cells = ", ".join(f"{v:.1f}" for v in runs[setup])
        lines.append(f"| {setup} | {value:.1f} ({cells}) | {value / minimal:.2f}x | {value / single:.2f}x |")
    compiled = result.get("compiled", "built")
    lines += ["", "`minimal` rows run their rounds in Python (numpy and socket calls around one C kernel call a device); "
              "`compiled minimal` rows the same rounds in C (eval/round_floor.c)" + (
                  "." if compiled == "built" else f": not run here ({compiled}).")]
    return lines


def check_arguments(args) -> None:
    if not args.agents or any(a < 1 for a in args.agents):
        raise SystemExit("--agents: a comma-separated list of agent counts, each 1 or more (e.g. 1,2,3)")
    if args.tokens < 8 or args.tokens + 8 + 6 > CONTEXT:
        raise SystemExit(f"--tokens: 8 to {CONTEXT - 14} (the prompt, warm-up and tokens fit {CONTEXT} positions)")
    if args.runs < 1 or args.seconds <= 0:
        raise SystemExit("--runs must be 1 or more and --seconds positive")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser)
    parser.add_argument("--agents", type=lambda s: [int(a) for a in s.split(",")], default=[1, 2, 3],
                        help="agent counts, comma-separated (default 1,2,3)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each bandwidth loop runs")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--name", default="round_floor")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    check_arguments(args)
    result = bench(args)
    write_report(args.out, args.name, result, render(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
