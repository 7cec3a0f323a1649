"""`halo-agent`: run the agent daemon (one per device)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tomllib
from pathlib import Path

from halo.errors import HaloError
from halo.linear import FORMATS

EPILOG = """examples:
  halo-agent --model /opt/halo/models/stories260K.bin --key /etc/halo/cluster.key --listen tcp://0.0.0.0:7070
  halo-agent --config /etc/halo/agent.toml            (keys: listen, key, model, name, weights, threads, predictors)
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="halo-agent", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Serve a share of a model's neuron groups to a halo master.")
    parser.add_argument("--config", help="TOML file with any of the options below")
    parser.add_argument("--listen", help="where to listen (default tcp://0.0.0.0:7070; port 0 = any free port)")
    parser.add_argument("--key", help="cluster key file (default /etc/halo/cluster.key)")
    parser.add_argument("--insecure", action="store_true", help="no key, plaintext: trusted test beds only")
    parser.add_argument("--model", help="local copy of the model: a GGUF file, llama2.c .bin, Hugging Face directory or "
                                        "a fetched model's name (default: the bundled stories260K)")
    parser.add_argument("--name", help="name shown to the master (default: the host name)")
    parser.add_argument("--weights", choices=FORMATS, help="weight format in memory when the master does not say "
                        "(default native: the file's own); a master's choice applies to the whole cluster")
    parser.add_argument("--threads", type=int, help="compute threads (default: all cores)")
    parser.add_argument("--predictors", help="trained predictors for --sync halo (default: predictors/ beside the model)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = {}
    if args.config:
        try:
            settings = tomllib.loads(Path(args.config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            print(f"halo-agent: error: cannot read {args.config}: {e}", file=sys.stderr)
            return 2
    pick = lambda name, default: getattr(args, name) or settings.get(name, default)  # noqa: E731
    threads = int(pick("threads", 0) or os.cpu_count() or 1)
    import numpy  # noqa: F401 - load its BLAS first: threadpool_limits only limits libraries already loaded
    from threadpoolctl import threadpool_limits

    threadpool_limits(threads)
    try:
        from halo.transport.reliable import load_key

        from .agent import Agent

        key = None if args.insecure else load_key(pick("key", "/etc/halo/cluster.key"))
        import socket

        agent = Agent(pick("model", None), pick("listen", "tcp://0.0.0.0:7070"), key, args.insecure,
                      pick("name", socket.gethostname()), pick("weights", "native"), threads,
                      pick("predictors", None))
    except HaloError as e:
        print(f"halo-agent: error: {e}", file=sys.stderr)
        return 2
    print(f"LISTENING {agent.endpoint}", flush=True)
    agent.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
