"""Every command-line value is checked before anything starts: one line naming the value, exit code 2, no traceback."""

import json
import re
import subprocess
import sys

import pytest

from halo.arguments import parse_endpoint, parse_endpoints
from halo.cli import master as cli
from halo.edge_agent import __main__ as agent_main
from halo.errors import ConfigError


def run(main, argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse refuses the value itself
        code = e.code
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, expected: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert expected in err, err


@pytest.mark.parametrize("argv, expected", [
    (["generate", "--agents", "not_an_address"], "argument --agents: address 'not_an_address' is not HOST:PORT"),
    (["generate", "--agents", "10.0.0.2:7070,pi-1"], "'pi-1' is not HOST:PORT"),
    (["generate", "--agents", "10.0.0.2:70000"], "port '70000' is not a number from 1 to 65535"),
    (["generate", "--agents", "10.0.0.2:0"], "port '0' is not a number from 1 to 65535"),
    (["generate", "--agents", "tcp://:7070"], "is not HOST:PORT"),
    (["generate", "--agents", "udp://10.0.0.2:7070"], "only tcp:// is supported"),
    (["generate", "--agents", "[::1]:7070"], "IPv6 addresses are not supported"),
    (["generate", "--agents", "a b:7070"], "neither an IPv4 address nor a host name"),
    (["generate", "--agents", "pi-1:7070,pi-1:7070"], "tcp://pi-1:7070 is given more than once"),
    (["generate", "--agents", ","], "no agent addresses"),
    (["generate", "--context", "0"], "argument --context: must be >= 1, got 0"),
    (["generate", "--context", "5000"], "--context 5000 is past the model's 512 positions"),  # was cut to 512 silently
    (["generate", "--context", "-5"], "argument --context: must be >= 1, got -5"),
    (["generate", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["generate", "--max-new-tokens", "ten"], "'ten' is not an integer"),
    (["generate", "--local-agents", "-1"], "argument --local-agents: must be from 0 to 64, got -1"),
    (["generate", "--threads", "0"], "argument --threads: must be from 1 to 1024, got 0"),
    (["generate", "--timeout", "0"], "argument --timeout: must be > 0, got 0"),
    (["generate", "--timeout", "-2"], "argument --timeout: must be > 0, got -2"),
    (["generate", "--timeout", "inf"], "argument --timeout: must be a finite number, got inf"),
    (["generate", "--temperature", "-0.5"], "argument --temperature: must be >= 0, got -0.5"),
    (["generate", "--temperature", "nan"], "argument --temperature: must be a finite number"),
    (["generate", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["generate", "--top-p", "1.01"], "argument --top-p: must be in (0, 1], got 1.01"),
    (["generate", "--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
    (["generate", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["generate", "--critical-fraction", "2"], "argument --critical-fraction: must be in [0, 1], got 2"),
    (["generate", "--inject-plr", "1"], "argument --inject-plr: must be in [0, 1), got 1"),
    # sync options where nothing reads them: accepted, and did nothing
    (["generate", "--inject-plr", "0.2"], "--inject-plr: how tensor-parallel agents sync their partial sums, and this run has none"),
    (["generate", "--local-agents", "2", "--sync", "lossy", "--critical-fraction", "0"],
     "--critical-fraction does nothing under --sync lossy: it applies to halo / halo-tcp"),
    (["generate", "--local-agents", "2", "--sync", "tcp", "--inject-plr", "0.3"], "--inject-plr does nothing under --sync tcp"),
    (["generate", "--local-agents", "2", "--sync", "tcp", "--deadline-floor", "9"], "--deadline-floor does nothing under --sync tcp"),
    (["generate", "--busy-poll", "on"], "--busy-poll: how tensor-parallel agents sync"),  # one process: no datagrams
    (["generate", "--local-agents", "2", "--sync", "tcp", "--no-udp-gso"], "--no-udp-gso does nothing under --sync tcp"),
    (["generate", "--local-agents", "2", "--wire-partials", "fp16"],
     "--wire-partials does nothing under --sync exact (the default)"),  # (it named a --sync exact nobody typed)
    (["generate", "--local-agents", "2", "--sync", "auto", "--wire-partials", "fp16"], "under --sync auto, which picks exact"),
    (["generate", "--deadline-floor", "0"], "argument --deadline-floor: must be > 0, got 0"),
    (["generate", "--weights", "int3"], "argument --weights: invalid choice: 'int3'"),
    (["plan", "--cluster", "c.toml", "--mlp-group-size", "0"], "argument --mlp-group-size: must be >= 1, got 0"),
    (["status", "--agents", "not_an_address"], "argument --agents: address 'not_an_address' is not HOST:PORT"),
    (["status", "--agents", "10.0.0.2:7070", "--timeout", "0"], "argument --timeout: must be > 0, got 0"),
    (["status"], "one of the arguments --agents --server is required"),
    (["serve", "--port", "70000"], "argument --port: must be from 0 to 65535, got 70000"),
    # a --slots that could not apply was set to 1 without a word
    (["serve", "--mode", "pipeline", "--local-agents", "1", "--slots", "4"],
     "--slots 4: --mode pipeline serves one request at a time"),
    (["serve", "--speculate", "2", "--slots", "4"], "--slots 4: --speculate serves one request at a time"),
    (["status", "--server", "http://127.0.0.1:1", "--watch", "--interval", "0"], "argument --interval: must be > 0, got 0"),
    (["keygen", "--out", "/proc/halo-test/cluster.key"], "cannot write the cluster key to /proc/halo-test/cluster.key"),
    (["plan", "--local-agents", "1", "--sync", "auto"], "--sync auto picks a mode when a session starts"),
    (["plan", "--local-agents", "1", "--sync", "reliable"], "--sync reliable was renamed: use --sync exact"),
    # plan took --agents / --local-agents unchecked (0 was a traceback; one agent twice was planned as two devices)
    (["plan", "--local-agents", "0"], "argument --local-agents: must be from 1"),
    (["plan", "--agents", "127.0.0.1:17081,127.0.0.1:17081"], "is given more than once"),
    (["plan", "--agents", "127.0.0.1:99999"], "port '99999' is not a number"),
    # an unwritable --out was a traceback after the planning; a plan of other MLP groups could never run
    (["plan", "--cluster", "/nonexistent.toml", "--out", "/nonexistent/dir/p.json"], "/nonexistent/dir is not a directory"),
    (["plan", "--cluster", "/nonexistent.toml", "--out", "/tmp"], "--out /tmp: is a directory"),
    (["plan", "--cluster", "/nonexistent.toml", "--mlp-group-size", "32", "--out", "p.json"], "--mlp-group-size with --out"),
    (["plan", "--cluster", "/nonexistent.toml", "--context", "100"], "a cluster file plans for its [cluster]"),
    (["plan", "--cluster", "/nonexistent.toml", "--threads", "2"], "--threads: for measured plans"),
    # accepted and ignored: a cluster file's plan measures and contacts nothing; status options of the other target
    (["plan", "--cluster", "/nonexistent.toml", "--rebenchmark", "--insecure"], "--rebenchmark / --insecure: for measured"),
    (["status", "--agents", "127.0.0.1:7070", "--watch", "--json"], "give one of them"),
    (["status", "--agents", "127.0.0.1:7070", "--interval", "5"], "--interval is --watch's refresh period"),
    (["status", "--agents", "127.0.0.1:7070", "--api-key", "k"], "--api-key is a running serve's"),
    (["status", "--server", "http://127.0.0.1:1", "--insecure"], "--insecure: how a master reaches agents"),
    # checked before any planner runs (a cluster file's pipeline and exact planners never looked at --sync)
    (["plan", "--cluster", "/nonexistent.toml", "--mode", "pipeline", "--sync", "auto"], "--sync: tensor-parallel planning only"),
    (["plan", "--cluster", "/nonexistent.toml", "--algorithm", "exact", "--sync", "reliable"], "--sync reliable was"),
])
def test_master_refuses_bad_values(argv, expected, capsys):
    assert_one_line(*run(cli.main, argv, capsys), expected)


@pytest.mark.parametrize("argv, expected", [
    (["--sync", "halo"], "--sync halo synchronizes agents: add --local-agents N"),
    (["--deadline-floor", "50", "--deadline-ceiling", "10", "--local-agents", "1"], "deadline floor 50.0 ms"),
    (["--local-agents", "2", "--agents", "10.0.0.2:7070"], "do not combine it with --agents"),
    (["--cluster", "a.toml", "--plan", "p.json"], "not both"),
    (["--model", "/nonexistent/model.bin"], "--model /nonexistent/model.bin: no such model file or directory"),
    (["--agents", "10.0.0.2:7070", "--cluster", "/nonexistent.toml"], "--cluster /nonexistent.toml: no such file"),
    (["--model", "m" * 300], "File name too long"),  # was an OSError traceback
    # the plan keywords are not files (they were refused as "--plan even: no such file")
    (["--plan", "even", "--sync", "halo", "--predictors", "/nonexistent"], "--predictors /nonexistent: no such directory"),
    (["--plan", "measured", "--sync", "halo", "--predictors", "/nonexistent"], "--predictors /nonexistent: no such directory"),
])
def test_generate_checks_combinations_before_loading(argv, expected, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr("halo.model.loader.load_weights", no_loading)
    assert_one_line(*run(cli.main, ["generate", *argv], capsys), expected)


def test_python_m_halo_cli_is_halo_master():
    out = subprocess.run([sys.executable, "-P", "-m", "halo.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "halo-master" in out.stdout and "generate" in out.stdout


def test_one_sync_option_for_every_command():
    """generate, serve and plan take the same --sync: the same modes, the same names, the same default."""
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    actions = [next(a for a in commands[name]._actions if "--sync" in a.option_strings)
               for name in ("generate", "serve", "plan")]
    assert len({(tuple(a.choices), a.default, a.metavar) for a in actions}) == 1
    assert actions[0].default is None and "auto" in actions[0].choices


def test_valid_addresses_become_canonical_endpoints():
    assert parse_endpoint("192.168.1.20:7070") == "tcp://192.168.1.20:7070"
    assert parse_endpoint("tcp://pi-1.local:7070") == "tcp://pi-1.local:7070"
    assert parse_endpoint(" localhost:1 ") == "tcp://localhost:1"
    assert parse_endpoints("a:1, b:2,") == ["tcp://a:1", "tcp://b:2"]
    assert parse_endpoint("tcp://*:0", listen=True) == "tcp://*:0"
    assert parse_endpoint("127.0.0.1:65535", listen=True) == "tcp://127.0.0.1:65535"
    for bad in ("*:7070", "host:65536", "host:-1", "host:", ":1", "host:1e3", "999.1.1.1.1:5", "host:\u0663",
                "host:" + "9" * 5000, "host:007070"):
        with pytest.raises(ConfigError):
            parse_endpoint(bad)


def write(tmp_path, text: str | bytes):
    path = tmp_path / "agent.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


@pytest.mark.parametrize("argv, expected", [
    (["--listen", "nothing"], "argument --listen: address 'nothing' is not HOST:PORT"),
    (["--listen", "tcp://0.0.0.0:70000"], "port '70000' is not a number from 0 (any free port) to 65535"),
    (["--listen", "tcp://no-such-host.invalid:7070"], "is not an address of this machine"),
    (["--threads", "0"], "argument --threads: must be from 1 to 1024, got 0"),
    (["--threads", "many"], "argument --threads: 'many' is not an integer"),
    (["--weights", "int4"], "argument --weights: invalid choice: 'int4'"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
    (["--memory-budget", "1e303"], "argument --memory-budget: must be in [1e-06, 1e+09]"),
    (["--config", "/nonexistent/agent.toml"], "cannot read /nonexistent/agent.toml"),
    (["--insecure", "--model", "/nonexistent/model.bin"], "--model /nonexistent/model.bin: no such model file"),
    (["--insecure", "--model", "m" * 300], "File name too long"),  # was blamed on --listen
])
def test_agent_refuses_bad_options(argv, expected, capsys):
    assert_one_line(*run(agent_main.main, argv, capsys), expected)


@pytest.mark.parametrize("text, expected", [
    ("threads = 0\n", "threads must be from 1 to 1024, got 0"),
    ("threads = \"4\"\n", "threads must be an integer, got '4'"),
    ("listen = \"tcp://0.0.0.0:99999\"\n", "listen: address 'tcp://0.0.0.0:99999': port '99999'"),
    ("listen = 7070\n", "listen must be a non-empty string, got 7070"),
    ("weights = \"int4\"\n", "weights must be one of native, fp32, int8, got 'int4'"),
    ("speed = 3\n", "unknown keys ['speed']; allowed: listen, key, model"),
    ("model = [1]\n", "model must be a non-empty string"),
    ("threads = \n", "cannot read"),
    ("name = " + "[" * 600 + "]" * 600 + "\n", "nested too deeply"),
    (b"\xff\xfe", "cannot read"),
    ("memory_budget = 1e303\n", "memory_budget (MB) must be in [1e-06, 1e+09]"),  # was an OverflowError traceback
    ("memory_budget = 1e-9\n", "memory_budget (MB) must be in [1e-06, 1e+09]"),  # was a budget of 0 bytes
    ("log_level = \"LOUD\"\n", "log_level must be one of DEBUG, INFO"),
])
def test_agent_refuses_bad_config_values(tmp_path, text, expected, capsys):
    assert_one_line(*run(agent_main.main, ["--config", write(tmp_path, text)], capsys), expected)


def test_the_agent_config_takes_the_log_level(tmp_path):
    """Under systemd the level could be changed only in the unit's ExecStart: log_level was an unknown key."""
    assert agent_main.read_config(write(tmp_path, 'log_level = "debug"\n')) == {"log_level": "debug"}


def test_agent_command_line_overrides_the_config(tmp_path, capsys):
    """A valid option on the command line wins over the file; the first error is then the missing key file."""
    config = write(tmp_path, "threads = 2\nlisten = \"tcp://127.0.0.1:0\"\nkey = \"/nonexistent/cluster.key\"\n")
    code, err = run(agent_main.main, ["--config", config, "--key", str(tmp_path / "other.key")], capsys)
    assert_one_line(code, err, f"{tmp_path / 'other.key'}: no cluster key file")


@pytest.mark.parametrize("module, prog", [("halo.edge_agent", "halo-agent"),
                                          ("halo.edge_agent.stage_worker", "halo-stage-worker")])
def test_a_daemon_says_when_its_port_is_taken(module, prog):
    """(halo-stage-worker printed zmq's traceback.)"""
    import zmq

    context = zmq.Context()
    holder = context.socket(zmq.ROUTER)
    try:
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        proc = subprocess.run([sys.executable, "-m", module, "--insecure", "--listen", f"127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=60)
    finally:
        context.destroy(linger=0)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(f"{prog}: error: cannot listen on (tcp://)?127.0.0.1:{port}: Address already in use", proc.stderr), proc.stderr


def test_the_issue_example_ends_in_one_line_without_traceback():
    """The reported case end to end: it used to end in zmq.error.ZMQError: Invalid argument."""
    proc = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--agents", "not_an_address"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "halo-master generate: error: argument --agents: address 'not_an_address' is not HOST:PORT "
        "(e.g. 192.168.1.20:7070 or pi-1.local:7070) (see halo-master generate --help)"]


def test_status_reports_a_peer_that_is_not_a_halo_agent(capsys):
    """Any ZeroMQ service answering on the port: an error row and exit code 1, not a MessageError traceback."""
    import threading

    import zmq

    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")

    def answer_garbage():
        if server.poll(10_000):
            identity, *_ = server.recv_multipart()
            server.send_multipart([identity, b"garbage"])

    thread = threading.Thread(target=answer_garbage)
    thread.start()
    try:
        code = cli.main(["status", "--agents", f"127.0.0.1:{port}", "--insecure", "--json", "--timeout", "10"])
    finally:
        thread.join()
        context.destroy(linger=0)
    rows = json.loads(capsys.readouterr().out)
    assert code == 1
    assert rows == [{"endpoint": f"tcp://127.0.0.1:{port}",
                     "error": "sent a malformed reply to status: expected at least 2 frames, got 1"}]


def test_the_shipped_agent_config_passes_the_checks():
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "rpi" / "agent.example.toml"
    settings = agent_main.read_config(str(example))
    assert settings["listen"] == "tcp://0.0.0.0:7070" and settings["threads"] == 4


def test_plaintext_stays_on_loopback_unless_told_otherwise(tmp_path):
    """--insecure on 0.0.0.0 let anyone on the LAN act as master and forge datagrams, with no warning."""
    import socket

    from halo.arguments import check_insecure

    with pytest.raises(ConfigError, match="--insecure-lan"):
        check_insecure(["tcp://127.0.0.1:7070", "tcp://192.168.1.20:7070"], False, "would talk plaintext to")
    check_insecure(["tcp://127.0.0.1:7070", "tcp://localhost:7070"], False, "would talk plaintext to")
    check_insecure(["tcp://192.168.1.20:7070"], True, "would talk plaintext to")
    agent = subprocess.run([sys.executable, "-m", "halo.edge_agent", "--insecure", "--listen", "0.0.0.0:0"],
                           capture_output=True, text=True, timeout=60)
    assert agent.returncode == 2 and "--insecure-lan" in agent.stderr and "0.0.0.0" in agent.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # 0.0.0.0 is no loopback name (refused before anything is sent), and would reach only this machine anyway
    master = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--agents", f"0.0.0.0:{port}", "--insecure",
                             "--max-new-tokens", "1"], capture_output=True, text=True, timeout=60)
    assert master.returncode == 2 and "--insecure-lan" in master.stderr, master.stderr


def test_status_on_a_narrow_terminal_prints_a_block_per_agent_not_a_table_cut_to_pieces():
    """At 80 columns (a pipe, a small terminal) eleven columns were each cut to a few letters ("age…", "ses…")."""
    from rich.console import Console

    row = {"name": "pi-kitchen", "endpoint": "tcp://10.0.0.7:7070", "session": None, "served": {"blocks": 12},
           "profile": {"cores": 4, "cpu_mhz": 1800.0, "compute_flops": 3.2e9, "memory_available_bytes": 3.1e9}}
    failed = {"endpoint": "tcp://10.0.0.8:7070", "error": "did not answer status: nothing accepted a connection there"}
    narrow = Console(width=80, record=True)
    narrow.print(cli._agents_table([row, failed], 80))
    text = narrow.export_text()
    assert "pi-kitchen tcp://10.0.0.7:7070" in text and "memory (MB): available / budget / held" in text
    assert "nothing accepted a connection there" in text.replace("\n", " ").replace("  ", " ") and "…" not in text
    assert "│ error " in text  # a block says what it is
    wide = Console(width=200, record=True)
    wide.print(cli._agents_table([row, failed], 200))
    table = wide.export_text()
    assert "halo agents" in table and "pi-kitchen" in table


def test_an_empty_system_message_is_still_a_chat(capsys):
    """--system "" was a plain completion (--help: --system implies --chat); the bundled model has no template."""
    code, err = run(cli.main, ["generate", "--system", "", "--prompt", "hi", "--max-new-tokens", "2"], capsys)
    assert code == 2 and "chat template" in err, err


def test_a_reader_that_leaves_early_or_a_terminal_without_utf8_is_no_traceback(tmp_path):
    """`generate | head -c 3` was a BrokenPipeError traceback; PYTHONIOENCODING=ascii a UnicodeEncodeError one."""
    import os

    done = subprocess.run(f"{sys.executable} -m halo.cli.master generate --prompt x --max-new-tokens 400 | head -c 3",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr and len(done.stdout) == 3, done.stderr
    done = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--prompt", "café", "--max-new-tokens",
                           "3"], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert done.returncode == 0 and "Traceback" not in done.stderr and done.stdout.startswith("caf?"), done.stderr


def test_an_unusable_predictors_directory_is_refused_under_lossy_sync_too(tmp_path, capsys):
    """Under --sync lossy (heads placed by the predictors' importance) an empty --predictors DIR was logged at info
    level and the heads silently kept their index order; halo mode refused it."""
    code, err = run(cli.main, ["generate", "--local-agents", "1", "--plan", "even", "--sync", "lossy", "--predictors",
                               str(tmp_path), "--max-new-tokens", "2"], capsys)
    assert code == 2 and "no predictor manifest" in err, err
