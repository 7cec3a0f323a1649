"""bench_serve refuses what it would ignore or trip on: the test bed's options without the testbed setting (they
were ignored), counts below one (a row of 0 clients; --slots 0 a RuntimeError), an unknown --testbed-sync."""

import pytest

from halo.eval import bench_serve


@pytest.mark.parametrize("argv, said", [
    (["--settings", "one", "--plr", "0.5"], "--plr: the testbed setting's options"),
    (["--settings", "one", "--profile", "wifi-bad"], "--profile: the testbed setting's options"),
    (["--settings", "many", "--clients", "0"], "must be at least 1"),
    (["--settings", "one", "--slots", "0"], "must be at least 1"),
    (["--settings", "testbed", "--testbed-sync", "bogus"], "--testbed-sync 'bogus'"),
])
def test_arguments_it_would_ignore_or_trip_on_are_refused(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        bench_serve.main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err
