"""The demo's job file, flags and plot, without a cluster."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from resilax_local.demo import runner as demo
from resilax_local.demo.examples import prepare_job, use_example, use_steps
from resilax_local.demo.timeline import Fault, LossRecord, build_plot_data
from resilax_operator.validation import validate_spec

T0 = 1_000_000.0


def test_demo_job_is_a_valid_elastic_two_slice_job() -> None:
    job = yaml.safe_load(demo.JOB_FILE.read_text())
    spec = validate_spec(job["spec"], name=job["metadata"]["name"])
    assert spec.elastic is not None
    assert (spec.slices.count, spec.elastic.min_count, spec.elastic.max_count) == (2, 1, 2)
    assert spec.elastic.grow_back
    assert spec.checkpoint.every.steps == 10
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["python", "examples/train.py"]
    assert (demo.FILES / command[1]).exists()


def test_demo_files_are_the_repositorys_own() -> None:
    """The package's demo files are links to the single sources in examples/ and charts/resilax/."""
    root = Path(demo.__file__).resolve().parents[3]
    for name, source in [("jaxjob-demo.yaml", "examples/jaxjob-demo.yaml"),
                         ("examples/train.py", "examples/train.py"),
                         ("examples/transformer.py", "examples/transformer.py"),
                         ("operator-rules.yaml", "charts/resilax/files/operator-rules.yaml"),
                         ("crds/jaxjobs.resilax.dev.yaml", "charts/resilax/crds/jaxjobs.resilax.dev.yaml"),
                         ("crds/kopf-peering.yaml", "charts/resilax/crds/kopf-peering.yaml")]:
        assert (demo.FILES / name).resolve() == root / source, name


def test_the_demo_can_run_the_transformer_instead() -> None:
    job = yaml.safe_load(demo.JOB_FILE.read_text())
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert use_example(command, "train") == command
    swapped = use_example(command, "transformer")
    assert swapped == [command[0], "examples/transformer.py", *command[2:]]
    assert (demo.FILES / swapped[1]).exists()
    with pytest.raises(ValueError, match="'mlp' is not one of train, transformer"):
        use_example(command, "mlp")


def test_the_demo_can_train_fewer_steps() -> None:
    job = yaml.safe_load(demo.JOB_FILE.read_text())
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--steps") + 1] == "300"
    assert use_steps(command, None) == command
    shorter = use_steps(use_example(command, "transformer"), 150)
    assert shorter == [command[0], "examples/transformer.py", "--steps", "150", *command[command.index("--steps") + 2:]]
    with pytest.raises(ValueError, match="has no --steps to replace"):
        use_steps(["python", "examples/train.py"], 150)


def test_the_job_is_prepared_to_run_here() -> None:
    job = prepare_job(yaml.safe_load(demo.JOB_FILE.read_text()), "ns", "/tmp/ckpt", "/files", "train", 160)
    assert job["metadata"]["namespace"] == "ns" and job["spec"]["checkpoint"]["storage"] == "/tmp/ckpt"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["workingDir"] == "/files"
    assert container["command"][:4] == ["python", "examples/train.py", "--steps", "160"], container["command"]


def test_too_few_steps_for_the_story_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--steps", "55"]) == 2  # refused before any folder or cluster is made
    err = capsys.readouterr().err
    assert "--steps 55 leaves no room" in err and "more than --fault-step + --dwell-steps (25 + 30)" in err, err


def test_demo_finds_the_chart_files() -> None:
    assert sorted(p.name for p in demo.CRD_DIR.glob("*.yaml")) == ["jaxjobs.resilax.dev.yaml", "kopf-peering.yaml"]
    rules = yaml.safe_load(demo.RULES_FILE.read_text())
    assert rules and all("verbs" in r for r in rules)


@pytest.mark.parametrize(("argv", "want"), [
    ([], {"keep": False, "timeout": 1200.0, "run_dir": None, "fault_step": 25, "dwell_steps": 30, "example": "train",
          "steps": None}),
    (["--keep", "--timeout", "60", "--run-dir", "/tmp/x", "--fault-step", "5", "--dwell-steps", "3",
      "--example", "transformer", "--steps", "120"],
     {"keep": True, "timeout": 60.0, "run_dir": Path("/tmp/x"), "fault_step": 5, "dwell_steps": 3,
      "example": "transformer", "steps": 120}),
])
def test_flags(argv: list[str], want: dict) -> None:
    assert vars(demo._parser().parse_args(argv)) == want


@pytest.mark.slow  # matplotlib's first import builds its font cache
def test_plot_is_written(tmp_path: Path) -> None:
    records = [LossRecord(s, math.exp(-s / 50) + 0.1, 1 if s <= 27 else 2, 8 if s <= 27 else 4, T0 + s)
               for s in range(1, 60)]
    records += [LossRecord(s, math.exp(-s / 50) + 0.1, 2, 4, T0 + 40 + s) for s in range(21, 28)]
    data = build_plot_data(records, [Fault(T0 + 27.5, "kill-node", "tpu-slice-1-h1")], start=T0)
    path = tmp_path / "loss.png"
    demo.render_plot(data, path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
