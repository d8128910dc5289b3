"""The `resilax` console script dispatches to lazily imported subcommands."""

import os
import subprocess
import sys

import pytest
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


def test_no_command_is_a_usage_error(capsys):
    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert "usage: resilax" in captured.err and captured.out == ""


def test_version():
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "resilax_operator.cli", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"resilax {version('resilax')}"


def test_demo_refuses_a_non_empty_folder_it_did_not_create(tmp_path, capsys):
    from resilax_local.demo import runner as demo

    mine = tmp_path / "my-project"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert demo.main(["--run-dir", str(mine)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me"


def _without_cap_sys_admin(*argv: str) -> list[str]:
    """`argv` run without CAP_SYS_ADMIN: as root, with it dropped (setpriv); a non-root user lacks it already."""
    if os.geteuid() != 0:
        return list(argv)
    return ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", *argv]


def test_local_up_without_cap_sys_admin_stops_before_starting_anything(tmp_path):
    """As root without CAP_SYS_ADMIN (as a non-root user), `local up` says why at once and starts nothing."""
    run_dir = tmp_path / "cluster"
    proc = subprocess.run(_without_cap_sys_admin(sys.executable, "-m", "resilax_operator.cli", "local", "up",
                                                 "--dir", str(run_dir)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "resilax local up: cannot create a mount namespace" in proc.stderr and "root" in proc.stderr
    assert not run_dir.exists()


def test_demo_without_cap_sys_admin_stops_before_creating_its_folder(tmp_path):
    run_dir = tmp_path / "demo"
    proc = subprocess.run(_without_cap_sys_admin(sys.executable, "-m", "resilax_operator.cli", "demo", "--run-dir",
                                                 str(run_dir)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "resilax demo: cannot create a mount namespace" in proc.stderr
    assert not run_dir.exists()


def test_isolation_probe_passes_where_the_cluster_tests_run(container_privileges):
    """Where the cluster tests run (root: the `container_privileges` fixture marks it `cluster`, which
    keeps it out of the fast tier, which runs without root)."""
    from resilax_local.launch import isolation_problem

    assert isolation_problem() is None


def test_a_subcommand_without_its_extra_names_the_extra_to_install():
    """As in a bare `pip install resilax`: the sidecar's aiohttp is missing (blocked here), so `resilax
    sidecar` says which extra brings it and exits 3, with no traceback."""
    code = ("import sys; sys.modules['aiohttp'] = None; from resilax_operator import cli; "
            "sys.exit(cli.main(['sidecar']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == cli.MISSING_EXTRA_EXIT == 3
    assert proc.stderr.strip() == ("resilax sidecar: this install lacks 'aiohttp', which the 'sidecar' extra "
                                   "brings; install it with: pip install 'resilax[sidecar]'")


REQUIRES = ['numpy>=2.0; extra == "train"', 'crc32c>=2.4; extra == "train"', 'kopf>=1.38; extra == "operator"',
            'crc32c>=2.4; extra == "sidecar"', 'resilax[operator,train]; extra == "local"',
            'jax[cpu]>=0.10; extra == "local"', 'pytest>=8; extra == "test"']


@pytest.mark.parametrize(("extra", "want"), [
    ("train", ["numpy", "crc32c"]),
    ("operator", ["kopf"]),
    ("local", ["jax", "kopf", "numpy", "crc32c"]),
    ("nothing", []),
], ids=["plain", "one", "nested-extras", "unknown"])
def test_plan_extra_distributions(extra, want):
    assert sorted(cli.plan_extra_distributions(REQUIRES, extra)) == sorted(want)


def test_every_subcommand_extra_is_installed_here():
    """The dev install has every extra: no subcommand would refuse to start."""
    assert {extra: cli.missing_distributions(extra) for _, _, extra in cli.SUBCOMMANDS.values()} == {
        "local": [], "operator": [], "sidecar": [], "train": [], "": []}
