"""Regenerate the shipped warm-ups of cpu_demo and cpu_state with tools/ship_warmup.py (the
package's own warm-up, from scratch, 5 to 13 minutes each on 2 cores) and check they still reach their
thresholds under the same keys as the shipped folders, and that shipping them writes readable folders replacing stale ones."""

from __future__ import annotations

import json

import pytest

from hacrl_megatron.config import load_config
from hacrl_megatron.trainer import pretrain
from tests.unit.tool_loading import load_tool

pytestmark = pytest.mark.slow


# cpu_size's two warm-ups are separate runs, the path cpu_demo already covers; regenerating them too would
# add 5-13 minutes to CI's slow step for no new code (tools/ship_warmup.py redoes them like the others)
@pytest.mark.parametrize("preset", ["cpu_demo", "cpu_state"])
def test_regenerated_warmups_reach_their_targets_under_the_shipped_keys(tmp_path, preset):
    tool = load_tool("ship_warmup")
    found = tool.regenerate(preset, tmp_path / "cache")  # raises when an agent stops below its target
    exp = load_config(preset)
    assert sorted(found) == sorted(a.name for a in exp.agents)
    for i, agent in enumerate(exp.agents):
        folder, info = found[agent.name]
        assert folder.name == pretrain.shipped_warmup(exp, i).name  # same key as what the package ships
        assert info["greedy_accuracy"] >= agent.warmup_sft_target
    out = tmp_path / "shipped"
    (out / f"{exp.agents[0].name}-000000000000").mkdir(parents=True)  # a stale warm-up of the same agent
    written = tool.ship(found, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)
    for path in written:
        assert all(f.stat().st_mode & 0o444 == 0o444 for f in path.iterdir())
        assert json.loads((path / pretrain.INFO_FILE).read_text())["steps"] >= 1
