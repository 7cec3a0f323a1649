"""`halo-master serve --mode pipeline`: the docs say serve runs any cluster generate builds; in pipeline mode it
died at start (the cluster view read the pipeline's report, a dict of stages, as a list of agents)."""

import json
import subprocess
import sys

import httpx

from serve_server import API_KEY, start_server, stop_server


def test_a_pipeline_cluster_serves_generates_text_and_shows_its_stages(tmp_path):
    process, url = start_server(tmp_path, "--mode", "pipeline", "--local-agents", "2")
    try:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        answer = httpx.post(url + "/v1/completions", headers=auth, timeout=120,
                            json={"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 12,
                                  "temperature": 0}).json()
        view = httpx.get(url + "/v1/halo/cluster", headers=auth, timeout=30).json()
    finally:
        stop_server(process)
    alone = subprocess.run([sys.executable, "-m", "halo.cli.master", "generate", "--prompt", "Once upon a time",
                            "--max-new-tokens", "12", "--json"], capture_output=True, text=True, timeout=120, check=True)
    assert answer["choices"][0]["text"] == json.loads(alone.stdout)["text"]
    stages = [d for d in view["devices"] if d["role"] == "stage"]
    assert len(stages) >= 1 and abs(sum(d["share"] for d in stages) - 1.0) < 0.01, view["devices"]
