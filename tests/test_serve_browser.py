"""The chat page and the live cluster view in a real browser: headless Chromium driven by playwright-core.

Needs Debian's `chromium`, `node` and `npm ci --prefix web` (playwright-core, which downloads no
browser; .ci/run installs all three); skips, saying which is missing, otherwise.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from serve_server import API_KEY, start_server, stop_server

WEB_DIR = Path(__file__).resolve().parents[1] / "web"


def browser_missing() -> str | None:
    if not shutil.which("chromium"):
        return "Debian's chromium is not installed (apt-get install chromium)"
    if not shutil.which("node"):
        return "node is not installed"
    if not (WEB_DIR / "node_modules" / "playwright-core").exists():
        return "playwright-core is not installed (npm ci --prefix web)"
    return None


@pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))
def test_chat_page_streams_an_answer_and_shows_live_cluster_numbers(tmp_path):
    process, url = start_server(tmp_path, "--local-agents", "2", "--plan", "even", "--sync", "halo", "--inject-plr", "0.05")
    try:
        shot = tmp_path / "page.png"
        out = subprocess.run(["node", str(WEB_DIR / "scripts" / "chat_page.mjs"), url, str(shot), API_KEY, "Once upon a time"],
                             capture_output=True, text=True, timeout=240)
    finally:
        stop_server(process)
    assert out.returncode == 0, out.stderr + out.stdout
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["problems"] == []
    assert seen["answer"].startswith("Once upon a time") and len(seen["answer"]) > 80
    assert "tokens" in seen["meta"] and "first token" in seen["meta"]
    assert seen["devices"][0][0].startswith("master") and seen["devices"][1][0].startswith("local-1")
    assert len(seen["devices"]) == 3 and all(row[1] == "●" for row in seen["devices"])
    assert float(seen["tokensPerS"]) > 0
    assert "partial sums lost chunks" in seen["lossSummary"] and seen["lossLayers"] > 0
    assert shot.stat().st_size > 20_000
