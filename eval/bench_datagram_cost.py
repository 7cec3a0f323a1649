"""What one datagram costs in CPU, sender and receiver: loopback against the namespace test bed.

    python -m halo.eval.bench_datagram_cost [--vectors 3000] [--plr 0,0.05]

A master process sends TinyLlama-sized vectors (2,052 float32: 6 datagrams) to 3 receivers, each vector to
every receiver with one `sendmmsg` (what the fast path does), a vector every 0.5 ms, once with each vector's 6
datagrams to a receiver as one segmented send (UDP GSO, the default) and once one message a datagram; the receivers
read and check them with `recvmmsg` (transport/_datagrams.c). Each process reports its own user and system CPU per datagram
(getrusage): loopback (127.0.0.2-4), then the bed (rpi/testbed.py: veths into a bridge, nftables loss rules)
at each PLR. Why: a round of the fast path is ~36 datagrams at 4 nodes, ~48 once parity is on; this says what
each costs beyond halo's own Python. Needs root and the C datagram path (exits 2 otherwise).
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import subprocess
import sys
import time

import numpy as np

from halo.runtime.local import module_command
from halo.transport import wire

PORT = 7450
KEY = bytes(range(wire.KEY_BYTES))
SESSION = 7
RECEIVERS = 3
DIM = 2052  # a TinyLlama-sized vector with its 4-float prefix: 6 float32 chunks


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _per_datagram(start: tuple[float, float], count: int) -> dict:
    user, system = _cpu()
    return {"user_us": 1e6 * (user - start[0]) / max(count, 1), "sys_us": 1e6 * (system - start[1]) / max(count, 1)}


def receive(bind: str) -> None:
    """Read until 2 s pass without a datagram (after the first); print the count and CPU per datagram."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((bind, PORT))
    state, count, start, batches = wire.Codec(KEY).state, 0, None, []
    while True:
        batch = wire._datagrams.receive(sock.fileno(), state, SESSION, 2.0, wire.Header)
        if not batch and start is not None:
            break
        if batch and start is None:
            start = _cpu()
        count += sum(1 for item in batch if not isinstance(item, str))
        batches.append(batch)  # looked into after the CPU is read
    cpu = _per_datagram(start, count)
    per_vector: dict[int, int] = {}  # epoch -> datagrams of it received
    for item in (item for batch in batches for item in batch if not isinstance(item, str)):
        per_vector[item[0].epoch] = per_vector.get(item[0].epoch, 0) + 1
    most = max(per_vector.values(), default=0)
    partial = sum(n < most for n in per_vector.values())  # vectors that lost some of their datagrams, not all
    print(json.dumps({"received": count, "partial_vectors": partial, **cpu}), flush=True)


def send(targets: list[str], vectors: int, segment: bool) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    codec = wire.Codec(KEY)
    payloads = wire.chunk_payloads(np.random.default_rng(0).standard_normal(DIM).astype(np.float32), wire.FLOAT32)
    addresses = [(t, PORT) for t in targets]
    time.sleep(0.5)  # the receivers are listening
    start, sent = _cpu(), 0
    for v in range(vectors):
        datagrams = codec.pack_chunks(wire.DATA, wire.FLOAT32, 0, SESSION, 2 * v + 2, 1 + len(payloads) * v, payloads)
        wire._datagrams.sendmany(sock.fileno(), datagrams, addresses, segment)
        sent += len(datagrams) * len(addresses)
        time.sleep(0.0005)
    print(json.dumps({"sent": sent, **_per_datagram(start, sent)}), flush=True)


def _measure(popen, hosts: list[tuple[str, str]], master_host: str | None, vectors: int, segment: bool) -> dict:
    """Receivers on hosts [(host, address)], then the sender; their reports."""
    receivers = [popen(host, module_command("halo.eval.bench_datagram_cost", "--role", "receive", "--bind", address))
                 for host, address in hosts]
    time.sleep(1.0)
    sender = popen(master_host, module_command("halo.eval.bench_datagram_cost", "--role", "send", "--vectors",
                                               vectors, *(() if segment else ("--no-segment",)),
                                               *[address for _, address in hosts]))
    out = {"segmented": segment, "sender": json.loads(sender.communicate(timeout=600)[0])}
    out["receivers"] = [json.loads(r.communicate(timeout=60)[0]) for r in receivers]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("send", "receive"), help=argparse.SUPPRESS)
    parser.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("targets", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--no-segment", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--vectors", type=int, default=3000, help="vectors sent to each receiver (default 3000)")
    parser.add_argument("--plr", default="0,0.05", help="loss rates on the test bed (default 0,0.05)")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    if wire._datagrams is None:
        print("bench_datagram_cost: halo.transport._datagrams is not built (no C compiler at install)", file=sys.stderr)
        return 2
    if args.role == "receive":
        receive(args.bind)
        return 0
    if args.role == "send":
        send(args.targets, args.vectors, not args.no_segment)
        return 0
    from halo.rpi.testbed import LossyTestbed, available

    ok, why = available()
    if not ok:
        print(f"bench_datagram_cost: cannot build the namespace test bed: {why}", file=sys.stderr)
        return 2
    pipe = {"stdout": subprocess.PIPE, "text": True}
    loopback = [(None, f"127.0.0.{i}") for i in range(2, 2 + RECEIVERS)]
    rows = [{"where": "loopback", "plr": 0.0, **_measure(lambda _host, argv: subprocess.Popen(argv, **pipe), loopback,
                                                          None, args.vectors, segment)} for segment in (False, True)]
    for plr in map(float, args.plr.split(",")):
        with LossyTestbed(RECEIVERS, prefix="hdc") as bed:
            bed.set_loss(plr)
            hosts = [(f"agent-{i}", bed.address(f"agent-{i}")) for i in range(1, RECEIVERS + 1)]
            for segment in (False, True, False, True):  # interleaved, twice: the VM drifts
                rows.append({"where": "test bed", "plr": plr, **_measure(lambda host, argv: bed.popen(host, argv, **pipe),
                                                                         hosts, "master", args.vectors, segment)})
    from halo.eval.report import command_line, write_report

    command = command_line("halo.eval.bench_datagram_cost", argv)
    lines = ["# CPU per datagram: loopback vs the namespace test bed", "",
             f"Command: `{command}`. One sender, {RECEIVERS} receivers, vectors of {DIM} float32 (6 datagrams, 5 of "
             "1,468 bytes) to each receiver by one `sendmmsg` every 0.5 ms, each vector to a receiver as one segmented "
             "message (UDP GSO) or one message a datagram; read with `recvmmsg` and checked in C (keyed BLAKE2b): user "
             "and system CPU per datagram from getrusage, in microseconds. Partial vectors: vectors a receiver got some "
             "but not all datagrams of (the bed must lose datagrams one by one, segmented or not).", "",
             "| where | PLR | send | sender user / sys us | receivers user / sys us (mean) | received of sent | "
             "partial vectors |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        s, r = row["sender"], row["receivers"]
        lines.append(f"| {row['where']} | {row['plr']:.0%} | {'segmented' if row['segmented'] else 'one a datagram'} | "
                     f"{s['user_us']:.2f} / {s['sys_us']:.2f} | "
                     f"{np.mean([x['user_us'] for x in r]):.2f} / {np.mean([x['sys_us'] for x in r]):.2f} | "
                     f"{sum(x['received'] for x in r)} of {s['sent']} | {sum(x['partial_vectors'] for x in r)} |")
    write_report(args.out, "datagram_cost", {"command": command, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    from halo.eval.report import run_script

    sys.exit(run_script(main))
