"""The control folder's JSON files are read bounded, without waiting and without following a link
(resilax_ckpt.control.control_files, issue 40): a FIFO, a link, a huge sparse file or a half-written file is
"no report", never a blocked or swollen reader; each reader of a control file goes through it."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from resilax_ckpt.control import requests, trainer_control, trainer_metrics
from resilax_ckpt.control.control_files import CONTROL_FILE_CAP, load_control_json


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _link(path: Path) -> None:
    target = path.parent / "elsewhere.json"
    target.write_text('{"step": 7}')
    os.symlink(target, path)


def _huge(path: Path) -> None:
    with open(path, "wb") as f:
        f.write(b'{"step": 7}')
        f.truncate(32 << 30)  # sparse


def _padded(path: Path) -> None:
    path.write_bytes(b'{"step": 7}' + b" " * CONTROL_FILE_CAP)


def _half_written(path: Path) -> None:
    path.write_bytes(b'{"step": ')


@pytest.mark.parametrize("make", [_fifo, _link, _huge, _padded, _half_written],
                         ids=["fifo", "link", "huge-sparse", "over-the-cap", "half-written"])
def test_a_control_file_in_the_wrong_shape_is_no_report_and_never_blocks(tmp_path: Path, make) -> None:
    readers = {
        requests.RESTORE_REPORT: lambda: requests.read_restore_report(str(tmp_path)),
        requests.STOP_RECORD: lambda: requests.read_stop_record(str(tmp_path)),
        trainer_control.STOP_FILE: lambda: trainer_control.read_stop(str(tmp_path)),
        trainer_metrics.TRAINER_FILE: lambda: trainer_metrics.read_trainer_figures(str(tmp_path)),
    }
    results: dict[str, object] = {}

    def read_all() -> None:
        for name, read in readers.items():
            make(tmp_path / name)
            results[name] = read()

    worker = threading.Thread(target=read_all, daemon=True)
    worker.start()
    worker.join(60)  # a liveness guard, not a timing: the reads take microseconds, a blocked one forever
    assert not worker.is_alive(), "a control file read blocked"
    assert results == dict.fromkeys(readers)


def test_a_regular_control_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text(json.dumps({"step": 7}))
    assert load_control_json(str(tmp_path / "x.json")) == {"step": 7}
    assert load_control_json(str(tmp_path / "missing.json")) is None
    requests.write_stop_record(str(tmp_path), 12, sigterm=True)
    assert requests.read_stop_record(str(tmp_path)) == 12
