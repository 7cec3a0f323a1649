"""Browser workers in headless Chromium: a stage on WebGPU (SwiftShader) and on WASM gives the tokens of
the single-process run; closing the tab mid-generation is recovered from like a lost native worker."""

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from halo.compute.transformer import Transformer
from halo.generation.generate import generate
from halo.model.loader import load_tokenizer, load_weights
from halo.pipeline.coordinator import PipelineModel
from halo.pipeline.links import LocalStage
from halo.pipeline.replan import Stage

WEB = Path(__file__).resolve().parents[1] / "web"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def missing() -> str | None:
    from halo.pipeline.browser import assets_built

    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)"
    if shutil.which("node") is None:
        return "no node to drive Chromium"
    if not (WEB / "node_modules" / "playwright-core").is_dir():
        return "web/node_modules missing: npm --prefix web ci"
    if not assets_built():
        return "worker page not built: npm --prefix web run build"
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return "aiohttp missing (the browser extra)"
    return None


pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))


class Tab:
    """A headless Chromium tab on the worker page (web/scripts/drive.mjs)."""

    def __init__(self, url: str, wasm: bool = False):
        argv = ["node", str(WEB / "scripts" / "drive.mjs"), url, "--timeout", "120"] + (["--wasm"] if wasm else [])
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def test_a_webgpu_stage_gives_the_single_process_tokens(stories_weights):
    from halo.pipeline.browser import BrowserHub

    tokenizer = load_tokenizer(stories_weights)
    reference = Transformer(stories_weights, max_seq_len=128)
    expected = generate(reference, tokenizer, "Once upon a time", 16)
    with BrowserHub(stories_weights, "127.0.0.1:0", 128, announce=lambda line: None) as hub:
        tab = Tab(hub.url)
        try:
            (browser,) = hub.wait_for_workers(1, 120)
            model = PipelineModel(stories_weights, [LocalStage(stories_weights, "master"), browser],
                                  [Stage(0, 0, 3), Stage(1, 3, 7)], 128, head_top_k=0)
            assert browser.engine == "onnx-webgpu"
            result = generate(model, tokenizer, "Once upon a time", 16)
            assert result.token_ids == expected.token_ids
            # full logits of a prefill and a decode step against the reference
            worst = 0.0
            for tokens, start in [(expected.prompt_ids, 0), ([expected.token_ids[0]], len(expected.prompt_ids))]:
                got = model.forward(tokens, start_pos=start, all_logits=True)
                want = reference.forward(tokens, start_pos=start, all_logits=True)
                worst = max(worst, float(np.abs(got - want).max()))
                assert (got.argmax(-1) == want.argmax(-1)).all()
            print(f"WebGPU stage: max |logit difference| = {worst:.2e}")
            assert worst < 1e-3
        finally:
            tab.close()


def test_a_wasm_stage_with_the_embedding_and_a_closed_tab_recovered(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import make_checkpoint

    from halo.pipeline.browser import BrowserHub

    make_checkpoint(tmp_path, seed=3, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=160)
    weights = load_weights(tmp_path)
    tokenizer = load_tokenizer(weights)
    expected = generate(Transformer(weights, max_seq_len=96), tokenizer, "Once upon a time", 40).token_ids
    with BrowserHub(weights, "127.0.0.1:0", 96, announce=lambda line: None) as hub:
        tab = Tab(hub.url, wasm=True)
        try:
            (browser,) = hub.wait_for_workers(1, 120)
            model = PipelineModel(weights, [browser, LocalStage(weights, "master")], [Stage(0, 0, 3), Stage(1, 3, 5)], 96)
            assert browser.engine == "onnx-wasm"

            closed = []

            def close_tab(piece):
                if not closed and model.step >= 20:
                    tab.close()
                    closed.append(model.step)

            assert len(expected) == 40  # no early EOS: the tab closes mid-generation
            result = generate(model, tokenizer, "Once upon a time", 40, on_text=close_tab, stop_at_eos=False)
            assert closed and result.token_ids == expected
            (recovery,) = model.report()["recoveries"]
            assert recovery["lost"][0].startswith("browser-1")
            assert [tuple(s) for s in recovery["members"]] == [("master", 0, 5)]
        finally:
            tab.close()
