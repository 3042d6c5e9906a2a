"""Every GPU recipe submits from the `make setup` venv (no Transformer Engine here): validated on this machine,
then handed to a stand-in address. Exit status 3 ("could not submit to ...") means the config passed every local
check and reached the submission step; 2 would be a refusal of the config."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_recipes import HARDWARE, user_overrides

from skyrl_mtp.cluster.submit import main

REPO = Path(__file__).resolve().parents[3]
STAND_IN = "http://127.0.0.1:9"   # nothing listens there


@pytest.mark.parametrize("recipe", sorted(r for r, *_ in HARDWARE))
def test_gpu_recipe_submits_from_a_workstation(recipe, tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("t" * 32)
    rc = main(["--address", STAND_IN, "--working-dir", str(REPO), "--auth-token-file", str(token), "--",
               f"recipe={recipe}", *user_overrides(recipe, tmp_path), f"trainer.run_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert f"could not submit to {STAND_IN}" in err and "invalid configuration" not in err
