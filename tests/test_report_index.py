"""eval/results/README.md names each result's host: its Host: line's, else the one its text mentions first."""

from halo.eval.report import host_named


def test_a_result_is_labelled_with_its_own_host_not_one_its_prose_compares_with():
    """halo_speed_tinyllama_q4.md ran on an Intel Xeon VM and said so, comparing with "the AMD EPYC host": the index
    took the first of its known hosts found anywhere, and said AMD EPYC."""
    assert host_named("(stop 45, an Intel Xeon VM: 49.8 ms here against 16.9 on the AMD EPYC host)") == "Intel Xeon"
    assert host_named("the AMD EPYC figures before\n\nHost: Intel Xeon, 2 cores.") == "Intel Xeon"
    assert host_named("no host named") == "-"
