"""The accuracy-under-loss study through the runtime (halo/eval/accuracy_runtime.py), on the bundled model."""

import json

import pytest

from halo import BUNDLED_MODEL
from halo.eval.accuracy_runtime import compared

from conftest import SHARED

DATA = SHARED / "data" / "tinystories_valid_dev.txt"


def test_comparison_counts_what_differs():
    reference = {"perplexity": 10.0, "top1": [1, 2, 3, 4], "continuations": [[1, 2], [3]], "chats": [[5], [6, 7]]}
    result = {"perplexity": 10.5, "top1": [1, 2, 0, 4], "continuations": [[1, 2], [4]], "chats": [[5], [6, 7]],
              "ms_per_token": 3.0}
    c = compared(result, reference)
    assert c["ppl_change"] == pytest.approx(0.05)
    assert (c["top1_agreement"], c["continuation_exact"], c["chat_identical"]) == (0.75, 0.5, 1.0)
    assert compared({**result, "chats": []}, {**reference, "chats": []})["chat_identical"] is None  # a base model


@pytest.mark.skipif(not DATA.exists(), reason=f"needs the held-out text {DATA}")
def test_exact_mode_under_injected_loss_scores_as_the_single_process(tmp_path):
    """10 % of every sender's datagrams dropped: exact mode recovers them all, so every score equals the
    reference's; halo mode runs the same study and accounts its drops."""
    from halo.eval.accuracy_runtime import main

    common = ["--model", str(BUNDLED_MODEL), "--agents", "1", "--plr", "0.1", "--ppl-tokens", "64", "--prompts", "2",
              "--continuation-tokens", "8", "--data", str(DATA), "--out", str(tmp_path)]
    assert main(common + ["--modes", "halo"]) == 0
    assert main(common + ["--modes", "exact", "--append"]) == 0  # a second run adds its rows, same reference
    data = json.loads((tmp_path / "accuracy_runtime_stories260K.json").read_text())
    halo, exact = data["rows"]
    assert len(data["commands"]) == 2
    assert (halo["sync"], exact["sync"]) == ("halo", "exact") and "error" not in halo and "error" not in exact
    assert exact["compared"]["top1_agreement"] == 1.0 and exact["compared"]["continuation_exact"] == 1.0
    assert exact["compared"]["ppl_change"] == pytest.approx(0.0, abs=1e-5)
    assert exact["loss"]["partials_dropped"] == 0 and halo["loss"]["partials"] > 0
    assert len(data["reference"]["nll"]) == 63 and "| 1 | exact | 10 % |" in (tmp_path / "accuracy_runtime_stories260K.md").read_text()
    with pytest.raises(SystemExit, match="other data"):
        main(common[:-6] + ["--prompts", "3", "--data", str(DATA), "--out", str(tmp_path), "--append"])


@pytest.mark.skipif(not DATA.exists(), reason=f"needs the held-out text {DATA}")
def test_on_radio_links_in_the_bed_exact_mode_scores_as_the_single_process(tmp_path):
    """--profile: master and agent each in a namespace of the test bed, the agent's link wifi-bad (10 % lost in
    bursts of ~8, 10 +- 5 ms) with 5 % more on its port: exact mode recovers every burst, so its scores are the
    reference's, and the row says where it ran."""
    from halo.rpi.testbed import available

    ok, why = available()
    if not ok:
        pytest.skip(f"the namespace test bed cannot run here: {why}")
    from halo.eval.accuracy_runtime import main

    assert main(["--model", str(BUNDLED_MODEL), "--profile", "wifi-bad", "--agents", "1", "--modes", "exact",
                 "--plr", "0.05", "--ppl-tokens", "32", "--prompts", "1", "--continuation-tokens", "4",
                 "--data", str(DATA), "--out", str(tmp_path), "--name", "bed", "--bed-timeout", "300"]) == 0
    data = json.loads((tmp_path / "bed.json").read_text())
    (row,) = data["rows"]
    assert "error" not in row, row
    assert (row["profile"], row["plan"], row["sync"]) == ("wifi-bad", "even-mlp-only", "exact")
    assert row["compared"]["top1_agreement"] == 1.0 and row["compared"]["continuation_exact"] == 1.0, row["compared"]
    assert row["compared"]["ppl_change"] == pytest.approx(0.0, abs=1e-5)
    assert row["loss"]["partials"] > 0 and row["loss"]["partials_dropped"] == 0
    assert sum(row["dropped_frames"].values()) > 0, row["dropped_frames"]  # the bed did lose frames
    assert "| 1 | exact, plan even-mlp-only | wifi-bad + 5 % |" in (tmp_path / "bed.md").read_text()


def test_append_refuses_a_reference_measured_on_other_text(tmp_path):
    """--append compared lengths only: other text of the same length reused the old reference, and a lossless exact
    row read -54 % perplexity and 16 % top-1 agreement."""
    from halo.eval.accuracy_runtime import data_fingerprint, previous_run

    data = {"windows": [[1, 5, 6]], "prompts": [[1, 7]], "chats": [], "continuation_tokens": 4, "answer_tokens": 4}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": "m.bin", "chat_prompts": "p.txt", "data_sha256": data_fingerprint(data, 64),
                                "reference": {}, "rows": [], "commands": []}))
    assert previous_run(path, "m.bin", data, "p.txt", 64)["rows"] == []
    other = {**data, "windows": [[1, 6, 5]]}  # the same lengths, other tokens
    for changed in ((other, 64), (data, 128)):
        with pytest.raises(SystemExit, match="scored other data"):
            previous_run(path, "m.bin", *changed[:1], "p.txt", changed[1])
