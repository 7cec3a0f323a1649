"""Where a sync round's fixed cost goes: the transport steps of one exact round, timed in one process.

    python -m halo.eval.bench_round_parts [--dim 2048] [--rounds 3000]

A master endpoint and an agent endpoint on loopback (the product's UdpEndpoint, keyed, C datagrams where built)
pass one decode round's vectors back and forth, as halo/distributed/rounds.py and edge_agent/rounds.py do, with no
compute and no waiting (each step finds its datagrams queued): the master frames and sends the input, the agent
takes it whole (whole_vector), frames and sends its partial, the master gathers it with an exact round's policy and
reads it. Beside them, the two things no Python change removes: keyed BLAKE2b over a vector's datagrams (packing;
checking costs the same) and the socket calls. What the steps take beyond those is interpreted bookkeeping.
Writes eval/results/NAME.{json,md} with the host.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from halo.eval.report import command_line, host, run_script, write_report

STEPS = ("master: frame + send input", "agent: take the input whole", "agent: frame + send partial",
         "master: gather the partial", "master: read the partial")


def measure(dim: int, rounds: int) -> dict:
    from halo.sync import Status
    from halo.sync.framing import frame_broadcast, frame_partial, partial_size, read_partial, reply_epoch
    from halo.transport import udp, wire

    key = bytes(range(32))
    master, agent = udp.UdpEndpoint(key, 7, 0), udp.UdpEndpoint(key, 7, 1)
    master.peers[1], agent.peers[0] = agent.address, master.address
    x = np.random.default_rng(0).standard_normal((1, dim)).astype(np.float32)
    policy = udp.GatherPolicy(deadline_s=0.01, hard_deadline_s=2.0, late_deadline_s=0.02, critical=frozenset({1}),
                              nack=frozenset({1}), silent_s=0.012)
    spent = np.zeros(len(STEPS))
    try:
        for i in range(rounds):
            epoch = 1000 + 2 * i
            t = [time.perf_counter()]
            master.send_vector({1: agent.address}, epoch, frame_broadcast(x, 5, 0, wire.values_per_chunk(wire.FLOAT32)))
            t.append(time.perf_counter())
            taken = agent.whole_vector(0, epoch - 1, lambda e: True)
            t.append(time.perf_counter())
            if taken is None:
                raise SystemExit("the agent did not find its input whole on loopback: the fast path is off")
            agent.send_vector({0: master.address}, reply_epoch(epoch), frame_partial(x, Status.OK, 0.1))
            t.append(time.perf_counter())
            result = master.gather(reply_epoch(epoch), {1: partial_size(1, dim)}, wire.FLOAT32, policy)
            t.append(time.perf_counter())
            read_partial(result.values[1], 1, dim)
            t.append(time.perf_counter())
            spent += np.diff(t)
        payloads = wire.chunk_payloads(np.concatenate([x[0], x[0, :8]]), wire.FLOAT32)
        t0 = time.perf_counter()
        for i in range(rounds):
            master.codec.pack_chunks(wire.DATA, wire.FLOAT32, 0, 7, 1, 1 + i * len(payloads), payloads)
        tags = (time.perf_counter() - t0) / rounds
    finally:
        master.close()
        agent.close()
    return {"steps_us": dict(zip(STEPS, (1e6 * spent / rounds).round(1).tolist())),
            "pack_and_tag_one_vector_us": round(1e6 * tags, 1), "datagrams_per_vector": len(payloads),
            "c_datagrams": wire._datagrams is not None}


def render(result: dict) -> list[str]:
    steps = result["steps_us"]
    tag = result["pack_and_tag_one_vector_us"]
    lines = [f"# A sync round's transport steps (D = {result['dim']})", "",
             f"Command: `{result['command']}`. Host: {result['host']['cpu']}, {result['host']['cores']} cores. One "
             f"process, loopback, {result['rounds']} rounds, no compute and no waiting: each step's mean.", "",
             "| step | us |", "|---|---|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in steps.items()]
    lines += [f"| **a round** | **{sum(steps.values()):.1f}** |", "",
              f"Packing and tagging one vector ({result['datagrams_per_vector']} datagrams, keyed BLAKE2b in "
              f"{'C' if result['c_datagrams'] else 'Python'}): {tag:.1f} us; a round packs two vectors and checks two: "
              f"~{4 * tag:.0f} us of it is the tags."]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=2048, help="the residual stream's width (TinyLlama: 2048)")
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--name", default="round_parts")
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    if not 64 <= args.dim <= 65536 or args.rounds < 10:
        raise SystemExit("--dim: 64 to 65536; --rounds: 10 or more")
    result = {"command": command_line("halo.eval.bench_round_parts", argv), "dim": args.dim, "rounds": args.rounds,
              "host": host(), **measure(args.dim, args.rounds)}
    write_report(args.out, args.name, result, render(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
