"""halo-stage-worker: runs a contiguous range of a model's layers for a pipeline coordinator.

A separate daemon from halo-agent (which serves neuron groups in tensor-parallel mode) because the two
hold different things and answer different messages; both share the control plane: a CURVE server
with the cluster key (transport/reliable.py), the same message codec, the same refusal rules.

Life of a worker: listen -> `probe` (answered any time: a benchmark of its own layer kernel, its
free memory, its engine) -> `hello` (protocol, model sha256, context, unit range): it loads only
those units from its local copy of the model (a memory map: other layers are never read) into
numpy on the CPU, or torch on CUDA where a GPU is present -> `forward` messages (token ids or the
residual stream at a position) answered with the stage output -> `bye`, or a newer coordinator says
hello. Every message is validated; a bad one gets an error with a reason and never ends the worker.
A forward that would leave a hole in the KV cache (a position after the cached ones) is refused:
the coordinator must replay what this worker never saw (halo/pipeline/coordinator.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass

import numpy as np

from halo.compute.linear import FORMATS
from halo.errors import HaloError
from halo.host.cores import usable_cores
from halo.transport.reliable import Message

from halo.edge_agent.daemon import ControlServer

log = logging.getLogger("halo.stage_worker")
IDLE_SESSION_S = 120.0


@dataclass
class StageSession:
    session: str
    peer: bytes
    engine: object
    start: int
    stop: int
    pos: int = 0  # positions held in the KV cache
    last_seen: float = 0.0


class StageWorker(ControlServer):
    def __init__(self, model_path: str | None, listen: str, key, insecure: bool = False, name: str = "stage",
                 device: str = "auto", threads: int = 1, memory_bytes: float | None = None, masters=None):
        super().__init__(model_path, listen, key, insecure, name, masters)
        self.device, self.threads, self.memory_limit = device, threads, memory_bytes
        self.session: StageSession | None = None
        self._probes: dict[str, dict] = {}  # self-benchmark per weight format (once each)
        self.served = {"sessions": 0, "forwards": 0, "compute_ms": 0.0, "refused": 0, "errors": 0}

    def tick(self, events: dict) -> None:
        if self.session and time.monotonic() - self.session.last_seen > IDLE_SESSION_S:
            log.warning("session %s idle for %.0f s: dropped", self.session.session, IDLE_SESSION_S)
            self.session = None

    def count_error(self) -> None:
        self.served["errors"] += 1

    def close(self) -> None:
        self.session = None
        super().close()

    # ---- messages ------------------------------------------------------------------------------------------
    def handle(self, message: Message, peer: bytes = b"", address: str | None = None) -> Message:
        f = message.fields
        if message.kind == "status":
            session = None if self.session is None else {
                "session": self.session.session, "units": [self.session.start, self.session.stop],
                "engine": self.session.engine.engine, "positions": self.session.pos}
            return Message("status", {"name": self.name, "model": self.weights.source, "session": session,
                                      "served": self.served})
        if message.kind == "ping":
            from halo.pipeline.protocol import MAX_PING_BYTES

            if len(message.arrays) > 1 or (message.arrays and message.arrays[0].nbytes > MAX_PING_BYTES):
                return Message("error", {"reason": f"a ping carries at most one payload of {MAX_PING_BYTES >> 20} MiB"})
            return Message("pong", {}, list(message.arrays))
        if message.kind == "probe":
            if reason := self._unservable(f):
                return self._refuse(reason)
            try:
                return Message("probe", self.probe(f.get("weights", "fp32")))
            except HaloError as e:
                return self._refuse(str(e))
        if message.kind == "hello":
            return self._hello(f, peer)
        if self.session is None:
            return Message("error", {"reason": f"'{message.kind}' before hello: no session"})
        if peer != self.session.peer or f.get("session") != self.session.session:
            return Message("error", {"reason": "not in session with this worker (another coordinator said hello since)"})
        self.session.last_seen = time.monotonic()
        if message.kind == "forward":
            return self._forward(message)
        if message.kind == "reset":
            self.session.engine.reset()
            self.session.pos = 0
            return Message("ok")
        if message.kind == "bye":
            log.info("session %s ended", self.session.session)
            self.session = None
            return Message("ok")
        return Message("error", {"reason": f"unknown message kind {message.kind!r}"})

    def _unservable(self, f: dict) -> str | None:
        """Why a probe or hello cannot be served on this worker's model (None: it can)."""
        if f.get("model_sha256") != self.model_sha256:
            return (f"model mismatch: the coordinator runs sha256 {str(f.get('model_sha256'))[:12]}..., this worker "
                    f"holds {self.model_sha256[:12]}... ({self.weights.source})")
        fmt = f.get("weights", "fp32")
        if fmt not in FORMATS:
            return f"unknown weight format {fmt!r}; a stage computes in {', '.join(FORMATS)}"
        return None

    def _refuse(self, reason: str) -> Message:
        self.served["refused"] += 1
        log.warning("refused: %s", reason)
        return Message("refused", {"reason": reason})

    def _make_engine(self, start: int, stop: int, context: int, fmt: str = "fp32"):
        from halo.pipeline.engines import make_engine

        return make_engine(self.weights, start, stop, context, fmt, self.threads, self.device)

    def probe(self, fmt: str = "fp32") -> dict:
        """Benchmark of this worker's own layer kernel in weight format `fmt` (once per format; cached) and its
        memory: the plan prices the stage by what its session will really run."""
        if fmt not in self._probes:
            from halo.pipeline.profile import time_engine

            c = self.weights.config
            engine = self._make_engine(1, 2, 64, fmt)
            per_layer, overhead = time_engine(lambda a, b: self._make_engine(a, b, 64, fmt), c.n_layers, c.dim)
            self._probes[fmt] = {"engine": engine.engine, "layer_s": per_layer, "overhead_s": overhead,
                                 "memory_bytes": self.memory_limit or _free_memory(engine.engine), "name": self.name,
                                 "weight_format": engine.weight_format}
            del engine
        return self._probes[fmt]

    def _hello(self, f: dict, peer: bytes) -> Message:
        from halo.pipeline.protocol import STAGE_PROTOCOL
        from halo.pipeline.stage import check_units

        if f.get("protocol") != STAGE_PROTOCOL:
            return self._refuse(f"stage protocol {f.get('protocol')} but this worker speaks {STAGE_PROTOCOL}: upgrade halo")
        if reason := self._unservable(f):
            return self._refuse(reason)
        c = self.weights.config
        try:
            start, stop, context = f["start"], f["stop"], f["context"]
            session, fmt = str(f["session"]), f.get("weights", "fp32")
            check_units(c, start, stop)
            if not isinstance(context, int) or not 0 < context <= c.max_seq_len:
                return self._refuse(f"context {context!r} must be within 1..{c.max_seq_len}")
            t = time.perf_counter()
            self.session = None  # a new coordinator replaces the old session (it is gone or done)
            engine = self._make_engine(start, stop, context, fmt)
        except HaloError as e:
            return self._refuse(str(e))
        except (KeyError, TypeError, ValueError) as e:
            return self._refuse(f"bad hello: {e!r}")
        self.session = StageSession(session, peer, engine, start, stop, last_seen=time.monotonic())
        self.served["sessions"] += 1
        load_ms = 1e3 * (time.perf_counter() - t)
        log.info("session %s: units [%d, %d) on %s, %.1f MB, loaded in %.0f ms", session, start, stop, engine.engine,
                 engine.weight_nbytes / 1e6, load_ms)
        return Message("ready", {"name": self.name, "engine": engine.engine, "weight_bytes": engine.weight_nbytes,
                                 "load_ms": load_ms})

    def _forward(self, message: Message) -> Message:
        from halo.pipeline.stage import HeadRequest

        s, f = self.session, message.fields
        start_pos = f.get("start_pos")
        if len(message.arrays) != 1 or not isinstance(start_pos, int) or isinstance(start_pos, bool) or start_pos < 0:
            return Message("error", {"reason": "a forward carries exactly one array and an integer start_pos >= 0"})
        if start_pos > s.pos:
            return Message("error", {"reason": f"position {start_pos} would leave a hole in the KV cache, which holds "
                                               f"{s.pos} positions: replay the missing ones first"})
        x = message.arrays[0]
        want = np.int64 if s.engine.takes_tokens else np.float32
        if x.dtype != want:
            return Message("error", {"reason": f"this stage takes {np.dtype(want).name} input, got {x.dtype}"})
        head = HeadRequest.from_json(f.get("head", HeadRequest().to_json()))
        t = time.perf_counter()
        outputs = s.engine.forward(x, start_pos, head)
        compute_ms = 1e3 * (time.perf_counter() - t)
        s.pos = start_pos + len(x)
        self.served["forwards"] += 1
        self.served["compute_ms"] += compute_ms
        return Message("output", {"compute_ms": compute_ms, "positions": s.pos}, outputs)


def _free_memory(engine: str) -> float:
    """What the engine's device has free: the GPU's for a CUDA engine (fp32 or fp16: "torch-cuda-fp16" was priced
    by the host's RAM), the host's otherwise."""
    if engine.startswith("torch-cuda"):
        import torch

        return float(torch.cuda.mem_get_info()[0])
    import psutil

    return float(psutil.virtual_memory().available)


EPILOG = """examples:
  halo-stage-worker --model /opt/halo/models/stories260K.bin --key /etc/halo/cluster.key --listen tcp://0.0.0.0:7080
  halo-stage-worker --model ./TinyLlama --device cuda --memory-mb 6000     a GPU box, at most 6 GB for halo
"""


def main(argv=None) -> int:
    from halo.arguments import (MAX_THREADS, OneLineParser, add_daemon_key_arguments, check_insecure, check_path,
                                integer, listen_argument, number)
    from halo.model.catalog import resolve_model

    parser = OneLineParser(prog="halo-stage-worker", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Serve a contiguous range of a model's layers to a halo pipeline "
                                       "coordinator (halo-master generate --mode pipeline).")
    parser.add_argument("--listen", type=listen_argument, default="tcp://0.0.0.0:7080", help="where to listen (default tcp://0.0.0.0:7080: every interface; port 0 = any free port)")
    add_daemon_key_arguments(parser)
    parser.add_argument("--model", help="local copy of the model (default: the bundled stories260K)")
    parser.add_argument("--name", help="name shown to the coordinator (default: the host name)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "torch-cpu"), default="auto",
                        help="auto: torch on CUDA where a GPU is present, else numpy on the CPU (default)")
    parser.add_argument("--threads", type=integer(0, MAX_THREADS), default=0, help="BLAS threads (default: all cores)")
    parser.add_argument("--memory-mb", type=number(0, low_open=True), help="memory the planner may give this worker (default: free memory)")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    threads = args.threads or usable_cores()
    from threadpoolctl import threadpool_limits

    threadpool_limits(threads)  # numpy's BLAS is loaded by now (halo imports numpy)
    import zmq

    from halo.edge_agent.daemon import start_failed

    try:
        from halo.transport.reliable import daemon_keys

        check_path("--model", str(resolve_model(args.model)) if args.model else None, "model file or directory")
        if args.insecure:
            check_insecure([args.listen], args.insecure_lan, "would listen in plaintext on")
        key, masters = (None, None) if args.insecure else daemon_keys(args.key, args.authorized_masters)
        import socket

        worker = StageWorker(args.model, args.listen, key, args.insecure, args.name or socket.gethostname(),
                             args.device, threads, args.memory_mb * 1e6 if args.memory_mb else None, masters)
    except HaloError as e:
        print(f"halo-stage-worker: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        print("halo-stage-worker: interrupted", file=sys.stderr)
        return 130
    except (zmq.ZMQError, OSError) as e:
        return start_failed("halo-stage-worker", args.listen, e)
    return worker.run_command("halo-stage-worker")


if __name__ == "__main__":
    sys.exit(main())
