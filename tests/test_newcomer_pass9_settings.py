"""Newcomer pass 9, settings that were accepted and ignored: no-effect keys set in a user's recipe file,
Hydra's own keys under --cfg job, autotune_configs on a CPU run, and an option several loss names own."""

import textwrap

import pytest

from framework.cli import train_main


def _err(capsys, argv, main=train_main):
    code = main(argv)
    return code, " ".join(capsys.readouterr().err.split())


# ---------------------------------------------------------------- 4. every owner of an option is named
@pytest.mark.parametrize("override", ["loss.z_loss=1e-4", "+loss.z_loss=1e-4"])
def test_an_option_several_loss_names_own_names_them_all(capsys, workdir, override):
    """Was: only loss=linear_ce was suggested, though loss=ce_zloss takes z_loss too."""
    code, err = _err(capsys, ["loss=ce", override, "--cfg", "job"])
    assert code == 2, err
    assert "an option of loss=linear_ce and loss=ce_zloss" in err, err
    assert "write loss=linear_ce loss.z_loss=1e-4 or loss=ce_zloss loss.z_loss=1e-4" in err, err
