"""Pure decisions as tables: boxes, chunks, resharding reads, retention, periodic policy, fencing."""

from __future__ import annotations

import pytest
from resilax_ckpt import layout, planning
from resilax_ckpt.errors import FencedError, MetadataError
from resilax_ckpt.history import fencing
from resilax_ckpt.metadata import ItemMetadata, LeafMetadata, StepMetadata
from resilax_ckpt.saving import policy

S = slice


@pytest.mark.parametrize(("index", "shape", "box"), [
    ((S(0, 4), S(2, 4)), (8, 4), ((0, 4), (2, 4))),
    ((S(None), S(None)), (8, 4), ((0, 8), (0, 4))),
    ((S(4, None),), (8, 4), ((4, 8), (0, 4))),
    ((), (), ()),
], ids=["slices", "full", "short-index", "scalar"])
def test_box_of_index(index, shape, box):
    assert planning.box_of_index(index, shape) == box


@pytest.mark.parametrize(("shape", "boxes", "chunks"), [
    ((8, 4), [((0, 4), (0, 2)), ((4, 8), (2, 4))], (4, 2)),
    ((10,), [((0, 4),), ((4, 8),), ((8, 10),)], (4,)),
    ((0, 3), [((0, 0), (0, 3))], (1, 3)),
    ((), [()], ()),
], ids=["grid", "uneven", "empty-dim", "scalar"])
def test_plan_chunk_shape(shape, boxes, chunks):
    assert planning.plan_chunk_shape(shape, boxes) == chunks


def test_plan_write_boxes_writes_replica_zero_once():
    shards = [((S(0, 4),), 0), ((S(0, 4),), 1), ((S(4, 8),), 1), ((S(4, 8),), 0), ((S(4, 8),), 0)]
    assert planning.plan_write_boxes(shards, (8,)) == [(0, ((0, 4),)), (3, ((4, 8),))]
    assert planning.plan_write_boxes([((S(4, 8),), 1)], (8,)) == []
    assert planning.plan_write_boxes([((S(4, 8),), 1)], (8,), all_replicas=True) == [(0, ((4, 8),))]


def test_plan_read_boxes_groups_devices_per_box():
    plan = planning.plan_read_boxes([("d0", (S(0, 4),)), ("d1", (S(0, 4),)), ("d2", (S(4, 8),))], (8,))
    assert plan == {((0, 4),): ["d0", "d1"], ((4, 8),): ["d2"]}


def _grid(rows, cols, r, c):
    """The boxes of a (rows x cols) array cut into (r x c)-element blocks."""
    return [((i, i + r), (j, j + c)) for i in range(0, rows, r) for j in range(0, cols, c)]


@pytest.mark.parametrize(("chunks", "per_process", "shard"), [
    ((2, 4), [_grid(8, 8, 2, 4)], (8, 8)),  # one process: the whole array in one file
    ((2, 4), [_grid(4, 8, 2, 4), [((a + 4, b + 4), c) for (a, b), c in _grid(4, 8, 2, 4)]], (4, 8)),  # row halves
    ((2, 4), [_grid(8, 4, 2, 4), [(r, (4, 8)) for r, _ in _grid(8, 4, 2, 4)]], (8, 4)),  # column halves
    ((8, 8), [[((0, 8), (0, 8))]], ()),  # a single chunk: nothing to gain
    ((2, 4), [_grid(8, 8, 2, 4)[:2], _grid(8, 8, 2, 4)[2:]], ()),  # blocks of different sizes
    ((2, 4), [[((0, 2), (0, 4)), ((4, 6), (0, 4))], [((2, 4), (0, 4)), ((6, 8), (0, 4))]], ()),  # interleaved
    ((4, 4), [[((0, 4), (0, 4))], [((0, 4), (0, 4)), ((4, 8), (0, 4))]], ()),  # a box on two processes
    ((), [[()]], ()),  # 0-d
], ids=["one-process", "row-halves", "column-halves", "one-chunk", "uneven-blocks", "interleaved", "replicated",
        "scalar"])
def test_plan_shard_shape_gives_each_process_whole_shards(chunks, per_process, shard):
    assert planning.plan_shard_shape(chunks, per_process) == shard


@pytest.mark.parametrize(("step", "last", "last_time", "now", "every_steps", "every_s", "save"), [
    (100, None, None, 0.0, 100, None, True),
    (101, 100, 0.0, 0.0, 100, None, False),
    (100, 100, 0.0, 0.0, 100, None, False),
    (7, 5, 0.0, 61.0, None, 60.0, True),
    (7, 5, 0.0, 59.0, None, 60.0, False),
    (7, 5, 0.0, 59.0, 7, 60.0, True),
], ids=["every-steps", "off-step", "already-saved", "seconds-due", "seconds-not-due", "first-wins"])
def test_decide_periodic_save(step, last, last_time, now, every_steps, every_s, save):
    assert policy.decide_periodic_save(step, last, last_time, now, every_steps, every_s) is save


@pytest.mark.parametrize(("step", "gen", "fences", "visible"), [
    (10, 1, {1: None}, True),
    (10, 1, {2: 10}, True),
    (11, 1, {2: 10}, False),
    (11, 1, {2: None}, False),
    (11, 2, {2: 10}, True),
    (11, 1, {2: 12, 3: 10}, False),
], ids=["own-fence", "seen-by-newer", "after-newer-started", "newer-saw-nothing", "newer-own-step",
        "two-newer"])
def test_decide_visible(step, gen, fences, visible):
    assert fencing.decide_visible(step, gen, fences) is visible


def test_check_not_fenced():
    fencing.check_not_fenced({1: None, 2: 5}, 2, "step 6")
    with pytest.raises(FencedError, match="generation 1 may not commit; a newer set of workers exists \\(generation 2\\)"):
        fencing.check_not_fenced({1: None, 2: 5}, 1, "step 6")


@pytest.mark.parametrize(("name", "step"), [("12", 12), ("0", 0), ("12/", 12), (".tmp-12-g1", None),
                                            ("_fences", None), ("1e3", None)])
def test_parse_step(name, step):
    assert layout.parse_step(name) == step


def test_tmp_names_carry_the_generation():
    assert layout.parse_tmp_generation(layout.tmp_name(12, 3)) == 3
    assert layout.parse_tmp_generation("12") is None


def test_leaf_dir_names_are_unique_and_safe():
    names = layout.leaf_dir_names(["['params']['w']", "['params'].w", "[0].mu['a/b']", ""])
    assert names == ["params.w", "params.w.1", "0.mu.a.b", "leaf3"]


def test_metadata_round_trip_and_version_check():
    leaf = LeafMetadata(keystr="['w']", path=[["d", "w"]], kind="array", dir="w", shape=(8, 4),
                        dtype="bfloat16", chunks=(4, 2))
    sharded = LeafMetadata(keystr="['v']", path=[["d", "v"]], kind="array", dir="v", shape=(8, 4),
                           dtype="float32", chunks=(2, 2), shard=(4, 4), checksum="crc32c")
    scalar = LeafMetadata(keystr="['s']", path=[["d", "s"]], kind="scalar", value=3, pytype="int")
    meta = StepMetadata(step=5, generation=2, process_count=2,
                        items={"params": ItemMetadata("pytree", (leaf, sharded, scalar)),
                               "meta": ItemMetadata("json")})
    assert StepMetadata.from_bytes(meta.to_bytes(), "x") == meta
    # Versions 1 (no shards) and 2 (no checksums) are still read.
    old = StepMetadata(step=5, generation=2, process_count=2, items={"params": ItemMetadata("pytree", (leaf,))})
    for version in (b"1", b"2"):
        assert StepMetadata.from_bytes(old.to_bytes().replace(b'"version": 3', b'"version": ' + version), "x") == old
    bad = meta.to_bytes().replace(b'"version": 3', b'"version": 99')
    with pytest.raises(MetadataError, match="format version 99 is not supported; this library reads versions 1, 2, 3"):
        StepMetadata.from_bytes(bad, "x")
    unknown = meta.to_bytes().replace(b'"checksum": "crc32c"', b'"checksum": "md5"')
    with pytest.raises(MetadataError, match="unknown checksum 'md5'"):
        StepMetadata.from_bytes(unknown, "x")
    with pytest.raises(MetadataError, match="not valid JSON"):
        StepMetadata.from_bytes(b"{", "x")


def test_offset_index():
    assert planning.offset_index(((4, 8), (2, 4)), ((4, 8), (0, 4))) == (slice(0, 4), slice(2, 4))
