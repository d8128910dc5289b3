"""The `resilax` console script dispatches to lazily imported subcommands."""

import subprocess
import sys

from resilax_operator import cli


def test_help_lists_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.SUBCOMMANDS:
        assert name in out


def test_unknown_subcommand_names_the_valid_ones(capsys):
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "'frobnicate'" in err and "local" in err


def test_cli_does_not_import_heavy_packages():
    code = "import sys; from resilax_operator import cli; cli.main(['--help']); print('jax' in sys.modules, 'kopf' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False False")
