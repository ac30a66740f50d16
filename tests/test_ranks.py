"""tests/support/ranks.py, the suite's rank launcher: what a hung launch leaves to read."""

import pytest
from conftest import free_port
from ranks import RanksTimedOut, run_ranks


@pytest.mark.slow  # forks 2 ranks
def test_a_hung_launch_reports_where_each_rank_was(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import sys, time\nprint('waiting', file=sys.stderr, flush=True)\ntime.sleep(600)\n"
    )
    with pytest.raises(RanksTimedOut) as raised:
        run_ranks(script, [], 2, {}, timeout=3, free_port=free_port)
    message = str(raised.value)
    for rank in (0, 1):
        stack = message.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "waiting" in stack and 'hang.py", line 3' in stack, message
