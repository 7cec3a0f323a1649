"""bench_halo_speed's sub-commands take only the options they read (ablation and straggler run their own
configuration: --model, --weights, --plan and --settings were accepted there and ignored, and --name too)."""

import pytest

from halo.eval import bench_halo_speed


@pytest.mark.parametrize("what, option", [("ablation", ["--model", "m.gguf"]), ("straggler", ["--plan", "even-mlp"]),
                                          ("ablation", ["--settings", '{"parity_group": 8}'])])
def test_options_a_sub_command_does_not_read_are_refused(what, option, capsys):
    with pytest.raises(SystemExit) as e:
        bench_halo_speed.main([what, *option])
    assert e.value.code == 2 and f"{option[0]}: speed and master options; {what} runs its own" in capsys.readouterr().err
