"""benchmarks/ab.py's pure parts (issue 49): its command line, a run's seconds per round from its round ends, and
the A/B table (each side's median, the per-repetition ratios HEAD/BASE with their range) from given figures. The
A/B run itself is a benchmark, not a test."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.support.paths import ROOT

SPEC = importlib.util.spec_from_file_location("ab_benchmark", ROOT / "benchmarks" / "ab.py")
assert SPEC is not None and SPEC.loader is not None
AB = importlib.util.module_from_spec(SPEC)
sys.modules["ab_benchmark"] = AB  # its dataclasses look their module up
SPEC.loader.exec_module(AB)


def test_the_command_line_takes_a_base_and_an_optional_head():
    args = AB.parse_args(["67f97c3"])
    assert (args.base, args.head, args.workloads, args.repeats, args.warmup) == (
        "67f97c3",
        None,
        ["fedavg", "flame"],
        3,
        1,
    )
    args = AB.parse_args(["67f97c3", "HEAD", "--workloads", "flame", "--repeats", "5", "--rounds", "4"])
    assert (args.head, args.workloads, args.repeats, args.rounds) == ("HEAD", ["flame"], 5, 4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["a", "--repeats", "0"], "--repeats 0: at least 1"),
        (["a", "--rounds", "2"], "--rounds 2: at least 3"),
        (["a", "--warmup", "-1"], "--warmup -1: 0 or more"),
        (["a", "--workloads", "resnet"], "invalid choice: 'resnet'"),
        ([], "the following arguments are required: BASE"),
    ],
)
def test_a_bad_command_line_is_refused_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        AB.parse_args(argv)
    assert message in capsys.readouterr().err


def test_seconds_per_round_is_the_median_gap_after_the_first_round_without_an_evaluating_last_round():
    ends = [
        10.0,
        11.0,
        13.0,
        14.5,
        20.0,
    ]  # gaps 1, 2, 1.5, 5.5: the last (an evaluation) is left out when it alone does
    assert AB.round_seconds(ends, last_evaluates=True) == 1.5
    assert AB.round_seconds(ends, last_evaluates=False) == 1.75
    assert AB.round_seconds([3.0, 4.0], last_evaluates=True) == 1.0


def _figures(seconds: float, startup: float, rss: float) -> dict[str, float]:
    return {"s/round": seconds, "start-up s": startup, "peak RSS MiB": rss, "workers CPU s": 9.0}


def test_the_table_pairs_repetitions_and_gives_each_ratio_its_range():
    runs = {
        "base": {"fedavg": [_figures(1.0, 10.0, 100.0), _figures(2.0, 12.0, 100.0), _figures(1.5, 11.0, 100.0)]},
        "head": {"fedavg": [_figures(0.5, 10.0, 50.0), _figures(1.0, 6.0, 50.0), _figures(1.5, 22.0, 50.0)]},
    }
    rows = {row.figure: row for row in AB.table_rows(runs, "base", "head")}
    assert list(rows) == ["s/round", "start-up s", "peak RSS MiB"]  # the run's other figures stay out of the table
    seconds = rows["s/round"]  # ratios 0.5, 0.5, 1.0, each HEAD run against the BASE run beside it
    assert (seconds.base, seconds.head, seconds.ratio, seconds.ratio_min, seconds.ratio_max) == (
        1.5,
        1.0,
        0.5,
        0.5,
        1.0,
    )
    startup = rows["start-up s"]  # ratios 1.0, 0.5, 2.0: the medians' ratio (10/11) is not the paired one
    assert (startup.ratio, startup.ratio_min, startup.ratio_max, startup.repetitions) == (1.0, 0.5, 2.0, 3)
    assert rows["peak RSS MiB"].ratio == 0.5
    table = AB.markdown(list(rows.values()), "base", "head")
    assert table.splitlines()[0] == "| workload | figure | base median | head median | ratio HEAD/BASE | min-max | n |"
    assert "| fedavg | s/round | 1.500 | 1.000 | 0.50 | 0.50-1.00 | 3 |" in table
    assert "| fedavg | peak RSS MiB | 100 | 50 | 0.50 | 0.50-0.50 | 3 |" in table


def test_a_workload_one_side_did_not_run_has_no_row():
    runs = {"base": {"flame": [_figures(1.0, 1.0, 1.0)]}, "head": {"flame": []}}
    assert AB.table_rows(runs, "base", "head") == []
