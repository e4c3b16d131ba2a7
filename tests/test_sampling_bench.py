"""bench/sampling.py --host-draw: the host's draw timed per parameter set, on rows of the given vocabulary."""
from bench.sampling import HOST_DRAWS, host_draws


def test_the_host_draw_rows_time_each_parameter_set():
    rows = host_draws(4096, rows=5)
    assert [row["path"] for row in rows] == list(HOST_DRAWS)
    assert all(row["vocab"] == 4096 and row["us_per_row"] > 0 for row in rows)
