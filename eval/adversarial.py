"""An attacker on the same network during a generation: replayed, random, forged and truncated datagrams.

    python -m halo.eval.adversarial [--datagrams 1000000] [--modes exact,lossy,halo] [--agents 2]
    python -m halo.eval.adversarial --http [--requests 10000]      (HTTP clients against serve: adversarial_http.py)

A generation of the bundled model runs over local agents while another process (another address: its
own socket) floods the agents and the master with a mix of: correctly tagged datagrams captured from
the master's earlier broadcasts, sent again (replays); random bytes; captured datagrams with one tag
byte flipped (forgeries); and truncated ones. What must hold: the generation completes, exact mode's
text equals the single-process run's, no datagram is ever sent to the flooder, and every refused
datagram is counted by reason. Writes eval/results/adversarial.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import sys
import time

import numpy as np

from halo.eval.report import command_line, run_script, write_report

CAPTURED_KEPT = 2000


def flood(captured: list[bytes], targets: list[tuple], total: int, rate: float, seconds: float, seed: int,
          results) -> None:
    """In its own process: send `total` datagrams (at most `rate` per second, for at most `seconds`) round-robin
    to the targets; count anything that comes back to this socket (nothing should)."""
    rng = np.random.default_rng(seed)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    kinds = {"replayed": 0, "random": 0, "forged": 0, "truncated": 0}
    received, sent, start = 0, 0, time.perf_counter()
    while sent < total and time.perf_counter() - start < seconds:
        kind = ("replayed", "random", "forged", "truncated")[sent % 4]
        base = captured[int(rng.integers(len(captured)))]
        if kind == "random":
            datagram = rng.bytes(int(rng.integers(1, 1500)))
        elif kind == "forged":
            datagram = base[:-1] + bytes([base[-1] ^ 0xFF])
        elif kind == "truncated":
            datagram = base[:int(rng.integers(1, len(base)))]
        else:
            datagram = base
        try:
            sock.sendto(datagram, targets[sent % len(targets)])
        except OSError:
            pass
        kinds[kind] += 1
        sent += 1
        while True:
            try:
                sock.recv(2048)
                received += 1
            except (BlockingIOError, OSError):
                break
        ahead = sent / rate - (time.perf_counter() - start)
        if ahead > 0.001:
            time.sleep(ahead)
    time.sleep(0.2)
    try:
        while True:
            sock.recv(2048)
            received += 1
    except (BlockingIOError, OSError):
        pass
    results.put({"sent": sent, "by_kind": kinds, "received_by_flooder": received,
                 "rate_per_s": sent / max(time.perf_counter() - start, 1e-9)})


def attacked_generation(mode: str, n_agents: int, datagrams: int, rate: float, tokens: int = 256,
                        seed: int = 0) -> dict:
    """One generation under the flood; what came of it."""
    from halo.compute.transformer import Transformer
    from halo.distributed import LocalCluster, cluster_model
    from halo.generation.generate import generate
    from halo.model.loader import load_tokenizer, load_weights
    from halo.sync import SyncSettings
    from halo.transport.reliable import Message, client_socket, decode, encode

    weights = load_weights()
    tokenizer = load_tokenizer(weights)
    expected = generate(Transformer(weights, max_seq_len=512), tokenizer, "", tokens).text
    with LocalCluster(n_agents) as cluster:
        model = cluster_model(weights, cluster.endpoints, cluster.key, context=512, timeout_s=10.0,
                              sync=SyncSettings(mode=mode))
        udp, captured = model.session.udp, []

        def capture(sock, datagram, address):
            if len(captured) < CAPTURED_KEPT:
                captured.append(bytes(datagram))
            sock.sendto(datagram, address)

        udp.send_hook = capture
        targets = [a.udp_address for a in model.agents.values()] + [("127.0.0.1", udp.address[1])]
        state = {"flooder": None}
        results = multiprocessing.get_context("spawn").Queue()
        started = []

        def on_text(_piece):
            if state["flooder"] is None and len(captured) >= 50:  # enough of the session to replay
                udp.send_hook = None
                state["flooder"] = multiprocessing.get_context("spawn").Process(
                    target=flood, args=(list(captured), targets, datagrams, rate, 600.0, seed, results), daemon=True)
                state["flooder"].start()
                started.append(time.perf_counter())

        try:
            t = time.perf_counter()
            result = generate(model, tokenizer, "", tokens, on_text=on_text)
            generation_s = time.perf_counter() - t
            while state["flooder"] is not None and state["flooder"].is_alive() and results.empty():
                model.reset()  # keep the session busy while the rest of the flood arrives
                generate(model, tokenizer, "", 16)
            flooded = results.get(timeout=120) if state["flooder"] is not None else {}
            master_rejected = model.sync_report().get("rejected", {})
            context = __import__("zmq").Context()
            agents_rejected = []
            for endpoint in cluster.endpoints:
                sock = client_socket(context, cluster.key)
                sock.connect(endpoint)
                sock.send_multipart(encode(Message("status")))
                status = decode(sock.recv_multipart()).fields if sock.poll(5000) else {}
                agents_rejected.append((status.get("session") or {}).get("rejected", {}))
            context.destroy(linger=0)
        finally:
            model.close()
    return {"mode": mode, "agents": n_agents, "tokens": len(result.token_ids), "generation_s": round(generation_s, 2),
            "text_equals_single_process": result.text == expected, "flood": flooded,
            "rejected_by_master": master_rejected, "rejected_by_agents": agents_rejected}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datagrams", type=int, default=1_000_000, help="in all, spread over the modes")
    parser.add_argument("--rate", type=float, default=20_000, help="flood datagrams per second (at most)")
    parser.add_argument("--modes", default="exact,lossy,halo")
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--out", default="eval/results")
    parser.add_argument("--http", action="store_true", help="attack `halo-master serve` over HTTP instead "
                        "(eval/adversarial_http.py): --requests of every bad kind while one client streams")
    parser.add_argument("--requests", type=int, default=10_000, help="with --http: attacking requests in all")
    parser.add_argument("--concurrency", type=int, default=32, help="with --http: attacking clients at once")
    args = parser.parse_args(argv)
    if args.http:
        from halo.eval.adversarial_http import run

        if args.requests < 1 or args.concurrency < 1:
            raise SystemExit("--requests and --concurrency: 1 or more")
        run(args.requests, args.concurrency, args.out, "adversarial_http", argv)
        return 0
    modes = args.modes.split(",")
    per_mode = -(-args.datagrams // len(modes))  # rounded up: at least --datagrams in all
    rows = [attacked_generation(m, args.agents, per_mode, args.rate) for m in modes]
    for r in rows:
        print(json.dumps(r), flush=True)
    command = command_line("halo.eval.adversarial", argv)
    total = sum(r["flood"].get("sent", 0) for r in rows)
    lines = ["# Replays, forgeries and garbage during generations", "",
             f"Command: `{command}`. The bundled model over {args.agents} local agents; another process floods the "
             f"agents and the master: {total:,} datagrams in all (a quarter each: captured broadcasts replayed, random "
             "bytes, captured with a flipped tag byte, truncated). The flood starts once the session is under way and "
             "runs on through further generations until it is spent.", "",
             "| mode | flood datagrams | rate /s | tokens | text = single process | sent to the flooder | refused by the master | refused by the agents |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["flood"]
        agents = [", ".join(f"{k} {v}" for k, v in a.items()) for a in r["rejected_by_agents"]]
        lines.append(f"| {r['mode']} | {f.get('sent', 0):,} | {f.get('rate_per_s', 0):,.0f} | {r['tokens']} | "
                     f"{'yes' if r['text_equals_single_process'] else 'no'} | {f.get('received_by_flooder')} | "
                     f"{', '.join(f'{k} {v}' for k, v in r['rejected_by_master'].items())} | {' / '.join(agents)} |")
    lines += ["", "lossy and halo modes may differ from the single-process text by design (they drop late or lost "
              "partial sums); what matters there is that nothing aborts and nothing is sent to the flooder."]
    write_report(args.out, "adversarial", {"command": command, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
