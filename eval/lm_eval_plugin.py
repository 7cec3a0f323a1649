"""lm-eval backend `halo`: evaluate a model through halo's runtime (single process or a cluster).

    halo-lm-eval --model halo --model_args local_agents=2,sync=halo,inject_plr=0.05 \\
        --tasks tinystories_ppl,tinystories_cloze

`halo-lm-eval` registers this backend beside lm-eval's built-in models, adds halo's offline task
folder to --include_path and runs lm-eval's own command line (every flag of `lm-eval run` works).

model_args (all optional):
  model=PATH|NAME       llama2.c .bin, GGUF, Hugging Face directory or a fetched model's name such as
                        smollm2-135m-instruct (default: bundled stories260K)
  tokenizer=PATH        its tokenizer (default: found beside the model)
  local_agents=N        start N agents on this machine; 0 with no agents/cluster = single process
  agents=H:P;H:P        running agents (';'-separated: lm-eval splits model_args at commas)
  cluster=FILE.toml     plan over a cluster file;  plan=FILE.json  a saved plan
  key=FILE, insecure=true   the cluster key, or plaintext agents
  sync=exact|tcp|lossy|halo|halo-tcp, deadline_floor_ms, deadline_ceiling_ms, critical_fraction,
  inject_plr=P, seed=S  drop P of every sender's UDP datagrams (seeded): accuracy under loss
  wire_partials=fp32|fp16   agents' partial sums on the wire in lossy/halo sync
  weights=fp32|int8|native (a GGUF's own 4-bit blocks), context=N, timeout=S, predictors=DIR, max_gen_toks=N
  cache_dir=DIR         keep answers in DIR/halo-lm-eval.sqlite, keyed by the model's sha256 and
                        every runtime setting above (a lossy run never reads a lossless run's answers)
  batch_size, device    accepted for the harness; requests run one at a time on the CPU

Requests: the continuation's tokens are those of tokenize(context + continuation) after the
context's tokens (as lm-eval's HF backend does; trailing spaces of the context move to the
continuation); contexts longer than the model's context keep their last tokens. Rolling
log-likelihoods use lm-eval's disjoint rolling windows of the model's context after BOS.
generate_until is greedy (sampling arguments are ignored with a warning) and cuts at the first
`until` string.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from halo.errors import ConfigError

try:
    from lm_eval.api.model import LM
except ImportError:  # (no [eval] extra: `halo-lm-eval` says what to install instead of a traceback)
    LM = None

log = logging.getLogger("halo.lm_eval")
SETTINGS = ("model", "tokenizer", "local_agents", "agents", "cluster", "plan", "sync", "deadline_floor_ms",
            "deadline_ceiling_ms", "critical_fraction", "inject_plr", "seed", "weights", "context", "predictors", "wire_partials")


def check_knobs_read(settings, changed: list[str], predictors) -> None:
    """model_args a cluster's sync mode does not read are refused, naming the modes that do (inject_plr=0.5 under
    sync=tcp scored the lossless run as the lossy one, as halo-master refuses --inject-plr there)."""
    from halo.sync.modes import KNOB_MODES

    for name in changed + ["predictors"] * bool(predictors):
        modes = KNOB_MODES.get(name, ("lossy", "halo", "halo-tcp"))  # (predictors: what ranks groups or places heads)
        if settings.mode not in modes:
            raise ConfigError(f"{name} does nothing under sync={settings.mode}: it applies to {' / '.join(modes)} "
                              f"(add sync={modes[0]}, or drop it)")


class HaloLM(LM or object):
    def __init__(self, model: str | None = None, tokenizer: str | None = None, local_agents: int = 0,
                 agents: str | None = None, cluster: str | None = None, plan: str | None = None,
                 key: str = "/etc/halo/cluster.key", insecure: bool = False, sync: str | None = None,
                 deadline_floor_ms: float = 5.0, deadline_ceiling_ms: float = 100.0, critical_fraction: float = 0.25,
                 inject_plr: float = 0.0, seed: int = 0, wire_partials: str = "fp32", weights: str = "fp32",
                 context: int | None = None,
                 timeout: float = 2.0, predictors: str | None = None, max_gen_toks: int = 256,
                 cache_dir: str | None = None, batch_size=None, device=None, **unknown):
        super().__init__()
        if unknown:
            raise ConfigError(f"unknown halo model_args {sorted(unknown)}; see `python -c \"import "
                              f"halo.eval.lm_eval_plugin as m; print(m.__doc__)\"`")
        if device not in (None, "cpu"):
            log.warning("halo runs on CPUs (its agents'); device=%s ignored", device)
        from halo.compute.transformer import Transformer
        from halo.model.loader import load_tokenizer, load_weights, model_fingerprint
        from halo.sync import SyncSettings

        from halo.model.catalog import resolve_model

        model = str(resolve_model(model)) if model else None  # a fetched model's name means its cached file
        self.weights = load_weights(model)
        self.tok = load_tokenizer(self.weights, tokenizer)
        self.bos = self.weights.config.bos_id
        self.eos = set(self.weights.config.eos_ids)
        self.max_gen_toks = int(max_gen_toks)
        settings = SyncSettings(mode=sync or "exact", deadline_floor_ms=float(deadline_floor_ms),
                                deadline_ceiling_ms=float(deadline_ceiling_ms),
                                critical_fraction=float(critical_fraction), inject_plr=float(inject_plr), seed=int(seed),
                                wire_partials=str(wire_partials))
        defaults = SyncSettings()
        changed = [name for name in ("inject_plr", "critical_fraction", "deadline_floor_ms", "deadline_ceiling_ms",
                                     "wire_partials") if getattr(settings, name) != getattr(defaults, name)]
        self._stack = ExitStack()
        agent_list = [a for a in str(agents).replace(";", " ").split() if a] if agents else None
        if local_agents or agent_list or cluster or plan:
            from halo.distributed import connect
            from halo.distributed.survive import SurvivalSettings

            check_knobs_read(settings, changed, predictors)

            self.model = connect(self.weights, self._stack, model_path=model, local_agents=int(local_agents or 0),
                                 agents=agent_list, cluster=cluster, plan=plan, key=key, insecure=bool(insecure),
                                 context=context, timeout=float(timeout), fmt=weights, sync=settings,
                                 predictors=predictors,
                                 # an agent lost is planned around; the plan never moves for speed alone, so that
                                 # which groups a lossy link drops stays the same through a whole accuracy run
                                 survive=SurvivalSettings(rebalance_every_s=0.0))
        else:
            if sync is not None:
                raise ConfigError(f"sync={sync} synchronizes agents: add local_agents=N, agents=... or cluster=...")
            if changed or predictors:  # accuracy "under 50 % loss" was the lossless figure, without a word
                raise ConfigError(f"{', '.join(changed + ['predictors'] * bool(predictors))}: set how a cluster's "
                                  "agents sync, and this run has none: add local_agents=N, agents=... or cluster=...")
            self.model = Transformer(self.weights, fmt=weights, max_seq_len=context)
        self.max_length = self.model.max_seq_len
        identity = {k: v for k, v in dict(model=model, tokenizer=tokenizer, local_agents=local_agents, agents=agents,
                                           cluster=cluster, plan=plan, weights=weights, context=self.max_length,
                                           predictors=predictors).items()}
        identity["model_sha256"] = model_fingerprint(self.weights.source)
        identity["sync"] = settings.to_json()
        self.identity = json.dumps(identity, sort_keys=True, default=str)
        self.cache = None
        if cache_dir:
            path = Path(cache_dir).expanduser()
            path.mkdir(parents=True, exist_ok=True)
            self.cache = sqlite3.connect(path / "halo-lm-eval.sqlite")
            self.cache.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, value TEXT)")
        self.cache_hits = 0

    # ---- plumbing ----------------------------------------------------------------------------------------
    def close(self) -> None:
        self._stack.close()
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _cached(self, method: str, args, compute):
        if self.cache is None:
            return compute()
        key = hashlib.sha256(json.dumps([self.identity, method, args], default=str).encode()).hexdigest()
        row = self.cache.execute("SELECT value FROM answers WHERE key = ?", (key,)).fetchone()
        if row is not None:
            self.cache_hits += 1
            return json.loads(row[0])
        value = compute()
        self.cache.execute("INSERT OR REPLACE INTO answers VALUES (?, ?)", (key, json.dumps(value)))
        self.cache.commit()
        return value

    def _progress(self, requests, disable: bool, what: str):
        from tqdm import tqdm

        return tqdm(requests, disable=disable or len(requests) < 2, desc=f"halo {what}")

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context tokens (BOS first) and the continuation's tokens as they fall in the whole text."""
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok.encode(context + continuation, bos=True)
        context_tokens = self.tok.encode(context, bos=True)
        return context_tokens, whole[len(context_tokens):]

    def score(self, context_tokens: list[int], continuation_tokens: list[int]) -> tuple[float, bool]:
        """log P(continuation | context) and whether greedy decoding would produce it."""
        if not continuation_tokens:
            return 0.0, True
        if len(continuation_tokens) > self.max_length:  # (an IndexError in the slicing below)
            raise ConfigError(f"a continuation of {len(continuation_tokens)} tokens does not fit the context of "
                              f"{self.max_length}: give a larger context=N in model_args (at most the model's)")
        tokens = list(context_tokens) + list(continuation_tokens)
        inputs = tokens[:-1][-self.max_length:]
        n = len(continuation_tokens)
        self.model.reset()
        logits = np.asarray(self.model.forward(inputs, start_pos=0, all_logits=True), dtype=np.float64)[-n:]
        logits -= logits.max(axis=-1, keepdims=True)
        logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        target = np.asarray(continuation_tokens)
        total = float(logprobs[np.arange(n), target].sum())
        return total, bool(np.all(logprobs.argmax(axis=-1) == target))

    # ---- the harness's three request types ---------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in self._progress(requests, disable_tqdm, "loglikelihood"):
            context, continuation = request.args
            answer = tuple(self._cached("loglikelihood", [context, continuation],
                                        lambda: list(self.score(*self.encode_pair(context, continuation)))))
            out.append(answer)
            self.cache_hook.add_partial("loglikelihood", (context, continuation), answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for request in self._progress(requests, disable_tqdm, "rolling loglikelihood"):
            (text,) = request.args

            def compute(text=text):
                tokens = self.tok.encode(text, bos=False)
                windows = map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.bos, max_seq_len=self.max_length, context_len=1))
                return float(sum(self.score(ctx, cont)[0] for ctx, cont in windows))

            value = self._cached("loglikelihood_rolling", [text], compute)
            out.append(value)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), value)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in self._progress(requests, disable_tqdm, "generate"):
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0) or 0) > 0:
                log.warning("halo's lm-eval backend decodes greedily; sampling arguments ignored")
            text = self._cached("generate_until", [context, until, max_new],
                                lambda: self.generate(context, until, max_new))
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, {"until": until, "max_gen_toks": max_new}), text)
        return out

    def generate(self, context: str, until: list[str], max_new: int) -> str:
        """Greedy continuation of context, cut before the first `until` string (or at EOS / the budget)."""
        prompt = self.tok.encode(context, bos=True)
        room = max(1, self.max_length - max_new)
        prompt = prompt[-room:]
        max_new = min(max_new, self.max_length - len(prompt))
        self.model.reset()
        logits = self.model.forward(prompt, start_pos=0)
        generated: list[int] = []
        text = ""
        for _ in range(max_new):
            token = int(np.argmax(logits))
            if token in self.eos:
                break
            generated.append(token)
            text = self.tok.decode(generated, at_start=not context)
            if any(u and u in text for u in until):
                break
            if len(prompt) + len(generated) >= self.max_length:
                break
            logits = self.model.forward([token])
        cuts = [text.find(u) for u in until if u and u in text]
        return text[:min(cuts)] if cuts else text


def register() -> None:
    """Make `--model halo` known to lm-eval, after its built-in models (lm-eval imports them lazily
    only while its registry is empty: registering first would hide them)."""
    import lm_eval.models  # noqa: F401  - fills the registry with the built-in models
    from lm_eval.api.registry import model_registry

    if "halo" not in model_registry:
        model_registry.register("halo")(HaloLM)


def main(argv: list[str] | None = None) -> int:
    """`halo-lm-eval`: lm-eval's command line with the halo backend and halo's offline tasks."""
    from halo.eval.lm_eval_tasks import TASKS_DIR

    argv = list(sys.argv[1:] if argv is None else argv)
    if LM is None:
        print("halo-lm-eval: error: lm-eval is not installed: pip install 'halo-edge[eval]'", file=sys.stderr)
        return 2
    if argv and argv[0] in ("-h", "--help") and len(argv) == 1:
        print(__doc__)
        print("lm-eval's own options follow.\n")
    register()
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        if any(a.startswith("--") for a in argv) or (argv and argv[0] in ("run", "ls", "validate")):
            argv += ["--include_path", str(TASKS_DIR)]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["halo-lm-eval", *argv]
    from halo.errors import HaloError, interrupted, sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():
            cli_evaluate()
    except HaloError as e:  # a bad model_args value, model file or cluster: one line, as halo-master says it
        print(f"halo-lm-eval: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # (local agents are stopped on the way out)
        return interrupted("halo-lm-eval", e)
    return 0


if __name__ == "__main__":
    from halo.eval.report import run_script

    sys.exit(run_script(main))
