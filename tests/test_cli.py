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
    from resilax_local import demo

    mine = tmp_path / "my-project"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert demo.main(["--run-dir", str(mine)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me"


def test_local_up_without_cap_sys_admin_stops_before_starting_anything(tmp_path):
    """As root without CAP_SYS_ADMIN (as a non-root user), `local up` says why at once and starts nothing."""
    run_dir = tmp_path / "cluster"
    proc = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-m",
                           "resilax_operator.cli", "local", "up", "--dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "resilax local up: cannot create a mount namespace" in proc.stderr and "root" in proc.stderr
    assert not run_dir.exists()


def test_demo_without_cap_sys_admin_stops_before_creating_its_folder(tmp_path):
    run_dir = tmp_path / "demo"
    proc = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-m",
                           "resilax_operator.cli", "demo", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "resilax demo: cannot create a mount namespace" in proc.stderr
    assert not run_dir.exists()


def test_isolation_probe_passes_where_the_cluster_tests_run():
    from resilax_local.launch import isolation_problem

    assert isolation_problem() is None
