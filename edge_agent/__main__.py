"""`halo-agent`: run the agent daemon (one per device)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tomllib
from pathlib import Path

from halo.arguments import (DEFAULT_KEY, MAX_THREADS, OneLineParser, add_daemon_key_arguments, check_insecure,
                            check_integer, check_number, check_path, integer, listen_argument, number, parse_endpoint)
from halo.compute.linear import FORMATS
from halo.errors import ConfigError, HaloError, interrupted, sigterm_as_interrupt
from halo.host.cores import usable_cores
from halo.model.catalog import resolve_model
from halo.transport.udp import BUSY_POLL_MODES

DEFAULT_LISTEN = "tcp://0.0.0.0:7070"

EPILOG = """examples:
  halo-agent --model /opt/halo/models/stories260K.bin --key /etc/halo/cluster.key --listen tcp://0.0.0.0:7070
  halo-agent prepare --model MODEL --weights native  (once: HALO mode's MLP groups laid out for re-mapping; see --help)
  halo-agent --config /etc/halo/agent.toml            (keys: listen, key, model, name, weights, threads, predictors,
                                                       memory_budget in MB, busy_poll, authorized_masters,
                                                       log_level)
"""


CONFIG_KEYS = ("listen", "key", "model", "name", "weights", "threads", "predictors", "memory_budget", "busy_poll",
               "authorized_masters", "log_level")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MEMORY_BUDGET_MB = (1e-6, 1e9)  # at least a byte (1e-9 was a budget of 0 bytes); above a petabyte it is a typo


def budget_bytes(megabytes: float | None) -> int | None:
    return None if megabytes is None else int(megabytes * 1e6)


def read_config(path: str) -> dict:
    """The agent's TOML file, every value checked as its command-line option would be."""
    try:
        settings = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    except RecursionError:
        raise ConfigError(f"cannot read {path}: nested too deeply for an agent configuration") from None
    unknown = sorted(set(settings) - set(CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown keys {unknown}; allowed: {', '.join(CONFIG_KEYS)}")
    for name, value in settings.items():
        if name == "threads":
            check_integer(value, f"{path}: threads", 1, MAX_THREADS)
        elif name == "memory_budget":
            check_number(value, f"{path}: memory_budget (MB)", *MEMORY_BUDGET_MB)
        elif not isinstance(value, str) or not value:
            raise ConfigError(f"{path}: {name} must be a non-empty string, got {value!r}")
    if "listen" in settings:
        try:
            settings["listen"] = parse_endpoint(settings["listen"], listen=True)
        except ConfigError as e:
            raise ConfigError(f"{path}: listen: {e}") from None
    if settings.get("busy_poll", BUSY_POLL_MODES[0]) not in BUSY_POLL_MODES:
        raise ConfigError(f"{path}: busy_poll must be one of {', '.join(BUSY_POLL_MODES)}, "
                          f"got {settings['busy_poll']!r}")
    if str(settings.get("log_level", "INFO")).upper() not in LOG_LEVELS:
        raise ConfigError(f"{path}: log_level must be one of {', '.join(LOG_LEVELS)}, got {settings['log_level']!r}")
    if settings.get("weights", FORMATS[0]) not in FORMATS:
        raise ConfigError(f"{path}: weights must be one of {', '.join(FORMATS)}, got {settings['weights']!r}")
    return settings


PREPARE_EPILOG = """HALO mode re-maps MLP groups per token; an agent whose memory budget cannot hold all of them keeps
what fits (compact: the groups' 4/8-bit codes and scales) and reads the ones a ranking needs when it needs them.
Prepared, each group is one contiguous read in that form (nothing to convert; SmolLM2 under a budget: ~2x faster
tokens than converting from the model file): run this once per device, model and weight format (the Pi
installer does). The agent finds the result by itself (a cache directory named by the model's sha256, the format
and the group size).

examples:
  halo-agent prepare --model /opt/halo/models/SmolLM2-135M-Instruct.Q4_1.gguf
  halo-agent prepare --model smollm2-135m-instruct --weights int8
"""


def prepare_main(argv: list[str]) -> int:
    """`halo-agent prepare`: write the model's MLP groups group-major in kernel form (halo/compute/prepared.py)."""
    parser = OneLineParser(prog="halo-agent prepare", epilog=PREPARE_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Write a model's MLP groups group-major for HALO mode's re-mapping under a "
                                       "memory budget.")
    parser.add_argument("--model", help="the model file (or a fetched model's name; default: the bundled stories260K)")
    parser.add_argument("--weights", choices=[f for f in FORMATS if f != "fp32"], default="native",
                        help="the weight format the cluster computes in (default native: a GGUF file's own blocks)")
    parser.add_argument("--mlp-group-size", type=integer(1, 1 << 20), help="neurons per MLP group (default: the "
                        "master's default for this model)")
    parser.add_argument("--out", help="directory to write, new or empty, or one prepare wrote before (replaced); "
                                      "default: the cache directory the agent looks in, where it finds it by itself")
    args = parser.parse_args(argv)
    try:
        from halo.compute.linear import resolve_format
        from halo.compute.neuron_groups import GroupLayout
        from halo.compute.prepared import prepare
        from halo.model.loader import load_weights, model_fingerprint

        weights = load_weights(args.model)
        fmt = resolve_format(args.weights, weights)
        if fmt == "fp32":
            raise ConfigError(f"{weights.source} has no compact blocks: --weights native is float32 here, which HALO "
                              "mode reads from the model file as it is; prepare --weights int8 instead")
        layout = GroupLayout.for_model(weights.config, args.mlp_group_size)
        with layer_progress(f"preparing {Path(str(weights.source)).name} ({fmt})", weights.config.n_layers) as done, \
                sigterm_as_interrupt():
            out = prepare(weights, model_fingerprint(weights.source), fmt, layout, Path(args.out) if args.out else None,
                          progress=done)
    except (HaloError, OSError) as e:
        print(f"halo-agent prepare: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # (what it had written is removed on the way out)
        return interrupted("halo-agent prepare", e)
    size = (out / "groups.bin").stat().st_size
    print(f"prepared {layout.n_mlp_groups} MLP groups x {weights.config.n_layers} layers ({size / 1e6:.1f} MB, {fmt}) "
          f"in {out}")
    return 0


@contextlib.contextmanager
def layer_progress(title: str, layers: int):
    """progress(done, total) for prepare: rich's bar where the coordinator's packages are installed, else (an edge
    device's core install, which prepare runs on) a counting line on stderr."""
    try:
        from rich.progress import Progress
    except ImportError:
        yield lambda done, total: print(f"\r{title}: {done}/{total} layers", end="\n" if done == total else "",
                                        file=sys.stderr, flush=True)
        return
    with Progress(transient=True) as bar:
        task = bar.add_task(title, total=layers)
        yield lambda done, total: bar.update(task, completed=done)


def agent_parser() -> argparse.ArgumentParser:
    """halo-agent's options (each may also come from --config's TOML file)."""
    parser = OneLineParser(prog="halo-agent", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Serve a share of a model's neuron groups to a halo master.")
    parser.add_argument("--config", help="TOML file with any of the options below")
    parser.add_argument("--listen", type=listen_argument,
                        help="where to listen (default tcp://0.0.0.0:7070; port 0 = any free port)")
    add_daemon_key_arguments(parser, key_default=None)  # (None: the config file's, else DEFAULT_KEY)
    parser.add_argument("--model", help="local copy of the model: a GGUF file, llama2.c .bin, Hugging Face directory or "
                                        "a fetched model's name (default: the bundled stories260K)")
    parser.add_argument("--name", help="name shown to the master (default: the host name)")
    parser.add_argument("--weights", choices=FORMATS, help="serve sessions in this weight format only: the master "
                        "picks the format for the whole cluster (halo-master --weights), and a hello in another is "
                        "refused with that fix (e.g. int8 on a device whose memory cannot hold native's float32 "
                        "checkpoint); default: whatever the master picks")
    parser.add_argument("--threads", type=integer(1, MAX_THREADS), help="compute threads (default: the cores this process may run on, its CPU affinity)")
    parser.add_argument("--predictors", help="trained predictors for --sync halo (default: predictors/ beside the model)")
    parser.add_argument("--memory-budget", type=number(*MEMORY_BUDGET_MB), metavar="MB",
                        help="most memory a session's weights and KV cache may take; a master's share that needs more "
                             "is refused with the numbers (default: 90 %% of the memory available at start)")
    parser.add_argument("--busy-poll", choices=BUSY_POLL_MODES,
                        help="while a generation runs, spin for the next UDP round instead of sleeping: on, off, or auto "
                             "= on where this process was given cores of its own (taskset, systemd CPUAffinity=); a "
                             "sleeping core wakes tens of microseconds late at every round, but agents sharing cores "
                             "must not spin (default auto)")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, help="default INFO")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        return prepare_main(argv[1:])
    args = agent_parser().parse_args(argv)
    try:
        settings = read_config(args.config) if args.config else {}
    except ConfigError as e:
        print(f"halo-agent: error: {e}", file=sys.stderr)
        return 2

    def pick(name, default):
        """The command line, else the config file, else the default."""
        given = getattr(args, name)
        return given if given is not None else settings.get(name, default)

    logging.basicConfig(level=pick("log_level", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if pick("weights", None):  # (it once did nothing: an old agent.toml's weights = "fp32" now refuses native masters)
        logging.getLogger("halo.agent").warning("weights = %s: this agent serves %s sessions only (a master computing "
                                                "in another format is refused)", pick("weights", None), pick("weights", None))

    threads = pick("threads", None) or usable_cores()
    listen = pick("listen", DEFAULT_LISTEN)
    try:
        model = pick("model", None)
        check_path("--model", str(resolve_model(model)) if model else None, "model file or directory")
        check_path("--predictors", pick("predictors", None), "directory")
    except ConfigError as e:
        print(f"halo-agent: error: {e}", file=sys.stderr)
        return 2
    import numpy  # noqa: F401 - load its BLAS first: threadpool_limits only limits libraries already loaded
    import zmq
    from threadpoolctl import threadpool_limits

    from halo.edge_agent.daemon import start_failed

    threadpool_limits(threads)
    try:
        from halo.transport.reliable import daemon_keys

        from halo.edge_agent.agent import Agent

        if args.insecure:
            check_insecure([listen], args.insecure_lan, "would listen in plaintext on")
        key, masters = (None, None) if args.insecure else daemon_keys(pick("key", DEFAULT_KEY),
                                                                       pick("authorized_masters", None))
        import socket

        agent = Agent(pick("model", None), listen, key, args.insecure,
                      pick("name", socket.gethostname()), pick("weights", None), threads,
                      pick("predictors", None), budget_bytes(pick("memory_budget", None)), pick("busy_poll", "auto"),
                      masters)
    except HaloError as e:
        print(f"halo-agent: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        print("halo-agent: interrupted", file=sys.stderr)
        return 130
    except (zmq.ZMQError, OSError) as e:
        return start_failed("halo-agent", listen, e)
    return agent.run_command("halo-agent")


if __name__ == "__main__":
    sys.exit(main())
