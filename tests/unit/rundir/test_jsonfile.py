"""rundir/jsonfile.py: the one reader of small JSON files that may be absent."""

from __future__ import annotations

import pytest

from andrea.data.manifest import Manifest
from andrea.data.sources import DataError
from andrea.rundir import checksum, sidecars
from andrea.rundir.jsonfile import read_json


class Bad(ValueError):
    pass


def test_an_absent_file_is_none_and_a_present_one_its_value(tmp_path):
    assert read_json(tmp_path / "none.json", Bad) is None
    (tmp_path / "a.json").write_text('{"x": [1, 2]}')
    assert read_json(tmp_path / "a.json", Bad) == {"x": [1, 2]}


def test_garbage_is_one_line_of_the_readers_error_naming_the_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("{not json")
    with pytest.raises(Bad, match=r"a\.json: not JSON here: ") as e:
        read_json(path, Bad, unreadable="cannot read: {e}", invalid="not JSON here: {e}")
    assert "\n" not in str(e.value)
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(Bad, match=r"a\.json: cannot read: "):
        read_json(path, Bad)


def test_constants_are_refused_only_when_asked(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"loss": NaN}')
    assert read_json(path, Bad)["loss"] != 0
    with pytest.raises(Bad, match="NaN is not allowed"):
        read_json(path, Bad, constants=False)


def test_the_three_readers_raise_their_own_error(tmp_path):
    (tmp_path / "data").mkdir()
    for path in (tmp_path / "data" / "manifest.json", tmp_path / "step_000001.sum.json", tmp_path / "s.json"):
        path.write_text("{")
    with pytest.raises(DataError, match="cannot read the data manifest"):
        Manifest.load(tmp_path / "data")
    with pytest.raises(checksum.ChecksumError, match="unreadable checksum"):
        checksum.read(tmp_path / "step_000001.bin")
    with pytest.raises(sidecars.SidecarError, match="not valid JSON"):
        sidecars.read_json(tmp_path / "s.json")
