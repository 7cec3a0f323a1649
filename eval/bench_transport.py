"""One synchronization round under real packet loss: TCP vs lossy-with-deadline vs the fast reliable path.

    python -m halo.eval.bench_transport [--agents 4,8] [--dims 2048,4096] [--plr 0,0.01,0.02,0.05] [--rounds 200]

Builds the namespace test bed (rpi/testbed.py: silent nftables loss on every agent link, both ways),
then for each setting runs a master and N agent processes in their namespaces. A round: the master
sends a D-float32 hidden state to every agent, each agent replies with a D-float32 partial sum, the
master has them all (or gives up at the deadline). Modes:
- tcp: both directions over TCP (Linux defaults, cubic, TCP_NODELAY);
- lossy: broadcast over the fast reliable path, partial sums over UDP with a 10 ms deadline, zero-filled;
- fast: both directions over the fast reliable path (P + Q parity per 6 chunks + NACK).
Reports p50/p99 round time and the fraction of partial-sum data delivered. Needs root (skips otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
from halo.runtime.local import module_command

PORT = 7400
MODES = ("tcp", "lossy", "fast")
DEADLINE_S = 0.010


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return bytes(data)


def agent(args) -> None:
    from halo.transport import wire
    from halo.transport.udp import GatherPolicy, UdpEndpoint

    partial = np.full(args.dim, float(args.node), dtype=np.float32)
    if args.mode == "tcp":
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((args.bind, PORT))
        server.listen(1)
        print("READY", flush=True)
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                _recv_exact(conn, 4 * args.dim)
                conn.sendall(partial.tobytes())
        except (ConnectionError, OSError):
            return
    endpoint = UdpEndpoint(bytes.fromhex(args.key), 1, args.node, bind=(args.bind, PORT))
    print("READY", flush=True)
    master = endpoint.peers[0] = (args.master, PORT)
    parity = 6 if args.mode == "fast" else 0
    for r in range(args.rounds):
        epoch = r << 20
        endpoint.gather(epoch, {0: args.dim}, policy=GatherPolicy(deadline_s=5.0, nack=True))
        endpoint.send_vector({0: master}, epoch, partial, wire.FLOAT32, parity)
    endpoint.serve(1.0)  # answer the master's last NACKs


def master(args) -> None:
    from halo.transport import wire
    from halo.transport.udp import GatherPolicy, UdpEndpoint

    addresses = {i: (a, PORT) for i, a in enumerate(args.agents.split(","), start=1)}
    hidden = np.random.default_rng(0).standard_normal(args.dim).astype(np.float32)
    times, delivered = [], []
    deadline = time.perf_counter() + args.time_limit
    if args.mode == "tcp":
        conns = {}
        for i, address in addresses.items():
            for _ in range(100):
                try:
                    conns[i] = socket.create_connection(address, timeout=5)
                    break
                except OSError:
                    time.sleep(0.05)
            conns[i].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(args.rounds):
            t = time.perf_counter()
            for c in conns.values():
                c.sendall(hidden.tobytes())
            for c in conns.values():
                _recv_exact(c, 4 * args.dim)
            times.append(time.perf_counter() - t)
            delivered.append(1.0)
            if time.perf_counter() > deadline:
                break
        for c in conns.values():
            c.close()
    else:
        endpoint = UdpEndpoint(bytes.fromhex(args.key), 1, 0, bind=(args.bind, PORT))
        endpoint.peers.update(addresses)
        for r in range(args.rounds):
            epoch = r << 20
            t = time.perf_counter()
            endpoint.send_vector(addresses, epoch, hidden, wire.FLOAT32, parity_group=6)
            fast = args.mode == "fast"
            policy = GatherPolicy(deadline_s=1.0 if fast else DEADLINE_S, nack=fast)
            result = endpoint.gather(epoch, {i: args.dim for i in addresses}, policy=policy)
            times.append(time.perf_counter() - t)
            delivered.append(result.delivered_fraction())
            if time.perf_counter() > deadline:
                break
        endpoint.serve(0.2)
    ms = 1e3 * np.array(times)
    print(json.dumps({"rounds": len(ms), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                      "mean_ms": float(ms.mean()), "delivered": float(np.mean(delivered)),
                      "exact_rounds": float(np.mean(np.array(delivered) == 1.0))}))


def run_setting(bed, n: int, dim: int, mode: str, rounds: int, time_limit: float, key: str) -> dict:
    me = module_command("halo.eval.bench_transport")
    common = ["--mode", mode, "--dim", str(dim), "--rounds", str(rounds), "--key", key]
    agents = [bed.popen(f"agent-{i}", me + ["--role", "agent", "--node", str(i), "--bind", bed.address(f"agent-{i}"),
                                            "--master", bed.address("master")] + common,
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i in range(1, n + 1)]
    try:
        for a in agents:  # every agent has bound its socket before the master sends anything
            if a.stdout.readline().strip() != "READY":
                raise RuntimeError("a benchmark agent did not start")
        out = bed.popen("master", me + ["--role", "master", "--bind", bed.address("master"), "--time-limit",
                                        str(time_limit), "--agents",
                                        ",".join(bed.address(f"agent-{i}") for i in range(1, n + 1))] + common,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = out.communicate(timeout=time_limit + 60)
        if out.returncode != 0:
            raise RuntimeError(f"master failed: {stderr[-2000:]}")
        return json.loads(stdout.strip().splitlines()[-1])
    finally:
        for a in agents:
            a.kill()
            a.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("agent", "master"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="fast", help=argparse.SUPPRESS)
    parser.add_argument("--node", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--master", default="", help=argparse.SUPPRESS)
    parser.add_argument("--key", default="", help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=4096, help=argparse.SUPPRESS)
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per setting at most")
    parser.add_argument("--agents", default="4,8", help="agent counts (or, for the master role, addresses)")
    parser.add_argument("--dims", default="2048,4096")
    parser.add_argument("--plr", default="0,0.01,0.02,0.05")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    if args.role == "agent":
        agent(args)
        return 0
    if args.role == "master":
        master(args)
        return 0
    from halo.rpi.testbed import LossyTestbed, available

    ok, why = available()
    if not ok:
        print(f"bench_transport: cannot build the namespace test bed: {why}", file=sys.stderr)
        return 2
    key = os.urandom(32).hex()
    rows = []
    for n in map(int, args.agents.split(",")):
        with LossyTestbed(n) as bed:
            for plr in map(float, args.plr.split(",")):
                bed.set_loss(plr)
                before = sum(bed.drop_counters().values())
                for dim in map(int, args.dims.split(",")):
                    for mode in MODES:
                        row = {"agents": n, "dim": dim, "plr": plr, "mode": mode,
                               **run_setting(bed, n, dim, mode, args.rounds, args.time_limit, key)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                rows[-1]["frames_dropped_at_this_plr"] = sum(bed.drop_counters().values()) - before
    from halo.eval.report import command_line, write_report

    command = command_line("halo.eval.bench_transport", argv)
    lines = ["# One synchronization round under real packet loss (namespace test bed)", "",
             f"Command: `{command}`. Loss: nftables `numgen random` drops on every agent link, both directions "
             "(bridge forward hook, silent to the sender). A round = master sends D float32 to each agent, each "
             "agent answers D float32. lossy: partial sums dropped after a 10 ms deadline (zero-filled); "
             "fast: P + Q parity per 6 chunks + NACK. p50 / p99 in ms; delivered = fraction of partial-sum data "
             "that arrived; exact = rounds with nothing missing.", "",
             "| agents | D | PLR | tcp p50 / p99 | lossy p50 / p99 (delivered, exact) | fast p50 / p99 (delivered) |",
             "|---|---|---|---|---|---|"]
    for n in sorted({r["agents"] for r in rows}):
        for dim in sorted({r["dim"] for r in rows}):
            for plr in sorted({r["plr"] for r in rows}):
                cell = {r["mode"]: r for r in rows if (r["agents"], r["dim"], r["plr"]) == (n, dim, plr)}
                t, lo, f = cell["tcp"], cell["lossy"], cell["fast"]
                lines.append(f"| {n} | {dim} | {plr:.0%} | {t['p50_ms']:.2f} / {t['p99_ms']:.1f} | "
                             f"{lo['p50_ms']:.2f} / {lo['p99_ms']:.1f} ({lo['delivered']:.3f}, {lo['exact_rounds']:.0%}) | "
                             f"{f['p50_ms']:.2f} / {f['p99_ms']:.1f} ({f['delivered']:.3f}) |")
    write_report(args.out, "transport_sync_round", {"command": command, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    from halo.eval.report import run_script

    sys.exit(run_script(main))
