"""eval/results/README.md indexes every result by date, host and command (python -m halo.eval.report index)."""

from halo.eval.report import index


def test_the_index_lists_every_result_with_its_host_and_command(tmp_path):
    (tmp_path / "a.md").write_text("# Speed of a\n\nCommand: `python -m halo.eval.bench_a --x 1`. Host: AMD EPYC, 2 cores.\n")
    (tmp_path / "b.md").write_text("# Notes of b | c\n\nno command here\n")
    (tmp_path / "README.md").write_text("# old index\n")
    lines = index(tmp_path)
    rows = [line for line in lines if line.startswith("| uncommitted")]
    assert rows == ["| uncommitted | [b.md](b.md) | Notes of b / c | - | - |",
                    "| uncommitted | [a.md](a.md) | Speed of a | AMD EPYC | `python -m halo.eval.bench_a --x 1` |"]
