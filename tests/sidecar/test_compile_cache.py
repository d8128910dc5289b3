"""JAX's persistent compilation cache, counted: a trainer process that joins with
`initialize_distributed_from_env` writes its cache requests and hits into trainer.json, and the sidecar
exports them as `resilax_trainer_compilation_cache_{hits,misses}_total{generation}` and logs them
once per generation (docs/architecture.md, "Compilation cache"). Real JAX processes, a real sidecar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from resilax_ckpt.control.trainer_metrics import read_trainer_figures

WORKER = Path(__file__).with_name("compile_cache_worker.py")


def _run_trainer(env: dict[str, str]) -> dict[str, int]:
    done = subprocess.run([sys.executable, str(WORKER)], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("COUNTS "))
    return json.loads(line[len("COUNTS "):])  # type: ignore[no-any-return]


def test_a_second_process_with_the_same_cache_folder_hits_the_cache_and_the_sidecar_exports_it(
        tmp_path: Path, sidecar_env: dict[str, str], start_sidecar: Any) -> None:
    control = sidecar_env["RESILAX_CONTROL_DIR"]
    env = {**sidecar_env, "RESILAX_GENERATION": "5", "RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    first = _run_trainer(env)
    assert first["requests"] > 0 and first["hits"] == 0, first
    figures = read_trainer_figures(control)
    assert figures is not None
    assert (figures["compilation_cache_requests"], figures["compilation_cache_hits"]) == (first["requests"], 0)

    second = _run_trainer({**env, "RESILAX_GENERATION": "6", "RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt6")})
    assert second["hits"] > 0, f"nothing served from the cache the first process filled: {second}"
    assert second["requests"] == first["requests"], "the same programs asked"
    figures = read_trainer_figures(control)
    assert figures is not None and figures["generation"] == 6
    assert figures["compilation_cache_hits"] > 0, figures

    sidecar = start_sidecar(env)
    hits = sidecar.metric("resilax_trainer_compilation_cache_hits_total", 'generation="6"')
    misses = sidecar.metric("resilax_trainer_compilation_cache_misses_total", 'generation="6"')
    assert hits == figures["compilation_cache_hits"] and hits > 0
    assert misses == figures["compilation_cache_requests"] - figures["compilation_cache_hits"]
    # ... and says it once in its log when it reads the trainer's figures (each /v1/state)
    sidecar.get("/v1/state")
    sidecar.get("/v1/state")
    said = f"trainer of generation 6 reached step 1: the compilation cache served {int(hits)} of its " \
           f"{figures['compilation_cache_requests']} compilations"
    assert sidecar.log().count(said) == 1, sidecar.log()[-2000:]
