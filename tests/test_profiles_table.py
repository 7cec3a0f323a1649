"""The headline table of link profiles (eval/profiles_table.py): every system's fastest setting, a stalled peer said
as such, and a run made before llama.cpp was in the benchmark said as not run."""

import json

from halo.eval import profiles_table


def result(rows: dict, stalled=(), command="python -m halo.eval.bench_peer ..."):
    return {"command": command, "host": "Host: test, 2 cores.",
            "rows": [{"sync": sync, "ms_mean": ms} for sync, ms in rows.items()], "stalled": list(stalled)}


def test_each_profile_row_holds_halo_and_the_fastest_setting_of_each_peer(tmp_path):
    (tmp_path / "peer_profile_ethernet.json").write_text(json.dumps(result(
        {"halo single process": 7.0, "exact": 15.0, "halo": 17.5, "exact@twice": 16.0, "halo@twice": 18.0,
         "dllama": 25.5, "dllama turbo": 80.0, "llama.cpp rpc": 24.0})))
    (tmp_path / "peer_profile_wifi-busy.json").write_text(json.dumps(result(
        {"halo single process": 7.1, "exact": 190.0, "halo": 180.0, "exact@twice": 150.0, "halo@twice": 140.0,
         "dllama": 23394.0},
        stalled=[{"sync": "dllama turbo", "why": "no timed token within 300 s"},
                 {"sync": "llama.cpp rpc", "why": "no result within 360 s"}])))
    (tmp_path / "peer_profile_wifi-good.json").write_text(json.dumps(result(  # from before --llamacpp
        {"halo single process": 7.3, "exact": 72.3, "halo": 65.5, "dllama": 201.1, "dllama turbo": 250.0})))
    assert profiles_table.main(["--results", str(tmp_path)]) == 0
    text = (tmp_path / "profiles_headline.md").read_text()
    assert "| 15.0 | 17.5 | 1.17x | 16.0 | 18.0 | 1.12x | 25.5 | 1.70x | 24.0 | 1.60x | 7.0 |" in text
    assert "| 65.5 | 0.91x | not run | not run | - | 201.1 | 3.07x | not run | - | 7.3 |" in text
    # the peers against halo's best setting (here HALO with two copies)
    assert ("| 190.0 | 180.0 | 0.95x | 150.0 | 140.0 | 0.93x | 23394.0 (dllama turbo: no timed token within 300 s) | "
            "167.10x | stalled (llama.cpp rpc: no result within 360 s) | -  | 7.1 |") in text
    rows = {r["profile"]: r for r in json.loads((tmp_path / "profiles_headline.json").read_text())["rows"]}
    assert rows["wifi-busy"]["llamacpp_ms"] is None and "llamacpp_ms" not in rows["wifi-good"]
