"""FedSLR's Fig. 3 material (fedslr.md B.3.1): the per-client gain over a reference run, from two per-client tables
(raysim.studies.gains), decided by hand-made tables."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from raysim.studies.gains import GainError, client_gains, gains_figure


def _table(ids, pm, gm, malicious=None):
    rows = {"client_id": ids, "pm_test_acc": pm, "gm_test_acc": gm, "num_train": [10] * len(ids)}
    if malicious is not None:
        rows["malicious"] = malicious
    return pd.DataFrame(rows)


def test_the_gains_are_the_per_client_differences_of_the_two_tables():
    reference = _table([2, 0, 1, 3], [0.5, 0.6, 0.7, 0.1], [0.5, 0.6, 0.7, 0.1], [False, False, False, True])
    fedslr = _table([0, 1, 2, 3], [0.9, 0.65, 0.4, 1.0], [0.62, 0.71, 0.52, 0.0], [False, False, False, True])
    pm, gm = client_gains({"fedslr": fedslr}, reference, ["pm_test_acc", "gm_test_acc"])
    assert (pm.label, pm.column, gm.column) == ("fedslr", "pm_test_acc", "gm_test_acc")
    np.testing.assert_array_equal(pm.client_ids, [0, 1, 2])  # the attacker (client 3) is left out
    # client by client, whatever the row order: reference gm of clients 0, 1, 2 = 0.6, 0.7, 0.5
    np.testing.assert_allclose(pm.gains, [0.9 - 0.6, 0.65 - 0.7, 0.4 - 0.5])
    np.testing.assert_allclose(gm.gains, [0.62 - 0.6, 0.71 - 0.7, 0.52 - 0.5])
    same = client_gains({"self": reference}, reference, ["gm_test_acc"])[0]
    assert not same.gains.any()  # a run against itself gains nothing anywhere


def test_tables_of_different_clients_or_without_the_column_are_refused():
    reference = _table([0, 1], [0.5, 0.6], [0.5, 0.6])
    with pytest.raises(GainError, match="its clients \\(3\\) are not the reference's \\(2\\)"):
        client_gains({"other": _table([0, 1, 2], [1, 1, 1], [1, 1, 1])}, reference)
    with pytest.raises(GainError, match="no column 'hm_test_acc'"):
        client_gains({"run": reference}, reference, ["hm_test_acc"])
    with pytest.raises(GainError, match="the reference table has no column 'x'"):
        client_gains({"run": reference}, reference, reference_column="x")


def test_the_figure_has_one_violin_per_run_and_column():
    reference = _table(list(range(20)), [0.5] * 20, np.linspace(0.4, 0.6, 20))
    runs = {
        name: _table(list(range(20)), np.linspace(0.3, 0.9, 20) + shift, [0.5] * 20)
        for name, shift in (("a", 0), ("b", 0.05))
    }
    gains = client_gains(runs, reference, ["pm_test_acc", "gm_test_acc"])
    figure = gains_figure(gains, "fedavg")
    axis = figure.axes[0]
    assert [t.get_text() for t in axis.get_xticklabels()] == [
        "a\npm_test_acc",
        "a\ngm_test_acc",
        "b\npm_test_acc",
        "b\ngm_test_acc",
    ]
    assert len(axis.collections) >= 4  # the violins' bodies (and the median and extrema lines)
