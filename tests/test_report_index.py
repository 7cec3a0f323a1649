"""eval/results/README.md names each result's host: its Host: line's, else the one its text mentions first."""

from halo.eval.report import host_named


def test_a_result_is_labelled_with_its_own_host_not_one_its_prose_compares_with():
    """halo_speed_tinyllama_q4.md ran on an Intel Xeon VM and said so, comparing with "the AMD EPYC host": the index
    took the first of its known hosts found anywhere, and said AMD EPYC."""
    assert host_named("(stop 45, an Intel Xeon VM: 49.8 ms here against 16.9 on the AMD EPYC host)") == "Intel Xeon"
    assert host_named("the AMD EPYC figures before\n\nHost: Intel Xeon, 2 cores.") == "Intel Xeon"
    assert host_named("no host named") == "-"


def test_index_help_and_a_missing_directory_are_messages_not_tracebacks(capsys):
    """(`report index --help` and `report index /nonexistent` were FileNotFoundError tracebacks.)"""
    from halo.eval.report import main

    assert main(["index", "--help"]) == 0 and "usage" in capsys.readouterr().err
    assert main(["index", "/nonexistent"]) == 2 and "no such results directory" in capsys.readouterr().err


def test_the_headline_table_skips_a_run_without_the_modes_it_compares(tmp_path, capsys):
    """A bench_peer run of other modes (--modes halo) was a KeyError: 'exact'."""
    import json

    from halo.eval import profiles_table

    (tmp_path / "peer_profile_ethernet.json").write_text(json.dumps({"rows": [{"sync": "halo", "ms_mean": 1.0}],
                                                                    "command": "x"}))
    assert profiles_table.main(["--results", str(tmp_path)]) == 2
    assert "no exact, halo single process row" in capsys.readouterr().err
