"""The one watcher of the tenant table and key file (kvfleet_runtime.config_watch), on real files."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import pytest

from factories import pool_entry, tenant_entry, tenant_table
from kvfleet_runtime.config import (
    KeyFile,
    TenantTable,
    dump_json,
    loads_in_steps,
)
from kvfleet_runtime.config_watch import (
    ConfigFile,
    ConfigRejection,
    RuntimeConfig,
    RuntimeConfigWatcher,
    file_signature,
)

SALT_KEY = "ab" * 32


def table(*names: str) -> TenantTable:
    return tenant_table(
        *(tenant_entry(n, hbm=1, hbm_burst=2) for n in names), pools=[pool_entry(hbm_blocks=100)]
    )


def keys(*names: str) -> KeyFile:
    return KeyFile(salt_key_hex=SALT_KEY, key_hashes={n: ["0" * 64] for n in names})


def write(folder: Path, tbl: TenantTable, kf: KeyFile) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tenants.json").write_text(dump_json(tbl))
    (folder / "keys.json").write_text(dump_json(kf))


def set_mtime(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


class Recorder:
    def __init__(self) -> None:
        self.rejections: list[ConfigRejection] = []

    def __call__(self, rejection: ConfigRejection) -> None:
        self.rejections.append(rejection)


def watcher_on(folder: Path) -> tuple[RuntimeConfigWatcher, Recorder]:
    recorder = Recorder()
    return RuntimeConfigWatcher(folder / "tenants.json", folder / "keys.json", on_rejected=recorder), recorder


def test_first_load_returns_the_pair_and_an_unchanged_poll_returns_nothing(tmp_path: Path) -> None:
    write(tmp_path, table("a"), keys("a"))
    watcher, _ = watcher_on(tmp_path)
    config = watcher.load()
    assert isinstance(config, RuntimeConfig)
    tbl, kf = config  # unpacks as the (table, key file) pair
    assert set(tbl.tenants) == {"a"} and set(kf.key_hashes) == {"a"}
    assert watcher.current == config
    assert watcher.poll() is None


def test_first_load_raises_on_a_bad_file(tmp_path: Path) -> None:
    write(tmp_path, table("a"), keys("a"))
    (tmp_path / "keys.json").write_text("{}")
    watcher, recorder = watcher_on(tmp_path)
    with pytest.raises(ValueError, match="salt_key_hex"):
        watcher.load()
    assert watcher.current is None and recorder.rejections == []  # start-up fails; nothing to keep


def test_a_poll_without_a_load_loads(tmp_path: Path) -> None:
    write(tmp_path, table("a"), keys("a"))
    watcher, _ = watcher_on(tmp_path)
    config = watcher.poll()
    assert config is not None and watcher.current == config
    assert watcher.poll() is None


def test_configmap_symlink_swap_with_equal_mtimes_is_seen(tmp_path: Path) -> None:
    """Kubernetes re-points ``..data`` at a new folder; the new files may carry the old mtimes and sizes."""
    mount = tmp_path / "mount"
    write(mount / "..v1", table("a"), keys("a"))
    (mount / "..data").symlink_to("..v1")
    for name in ("tenants.json", "keys.json"):
        (mount / name).symlink_to(f"..data/{name}")
    watcher, _ = watcher_on(mount)
    watcher.load()
    write(mount / "..v2", table("b"), keys("b"))  # same sizes: "a" and "b" are one character each
    for name in ("tenants.json", "keys.json"):
        old = mount / "..v1" / name
        set_mtime(mount / "..v2" / name, old.stat().st_mtime_ns)
        assert (mount / "..v2" / name).stat().st_size == old.stat().st_size
    (mount / "..tmp").symlink_to("..v2")
    os.replace(mount / "..tmp", mount / "..data")
    config = watcher.poll()
    assert config is not None and set(config.table.tenants) == {"b"}


def test_atomic_rename_with_equal_mtime_and_size_is_seen(tmp_path: Path) -> None:
    write(tmp_path, table("a"), keys("a"))
    watcher, _ = watcher_on(tmp_path)
    watcher.load()
    before = (tmp_path / "tenants.json").stat()
    (tmp_path / "new.json").write_text(dump_json(table("b")))
    set_mtime(tmp_path / "new.json", before.st_mtime_ns)
    os.replace(tmp_path / "new.json", tmp_path / "tenants.json")
    after = (tmp_path / "tenants.json").stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    config = watcher.poll()
    assert config is not None and set(config.table.tenants) == {"b"}


def test_a_change_of_the_key_file_alone_is_seen(tmp_path: Path) -> None:
    write(tmp_path, table("a", "b"), keys("a"))
    watcher, _ = watcher_on(tmp_path)
    watcher.load()
    (tmp_path / "keys.json").write_text(dump_json(keys("a", "b")))
    config = watcher.poll()
    assert config is not None and set(config.keys.key_hashes) == {"a", "b"}


def test_an_invalid_file_keeps_the_last_good_pair_and_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path, table("a"), keys("a"))
    watcher, recorder = watcher_on(tmp_path)
    good = watcher.load()
    caplog.set_level(logging.ERROR)
    (tmp_path / "tenants.json").write_text('{"schema_version": 1, "tenants": "SECRET-MARKER"}')
    assert watcher.poll() is None
    assert watcher.poll() is None  # unchanged since: not reported again
    assert watcher.current == good and watcher.failures == 1
    assert [(r.file, r.path) for r in recorder.rejections] == [
        (ConfigFile.TENANT_TABLE, tmp_path / "tenants.json")
    ]
    assert "rejected" in caplog.text and "SECRET-MARKER" not in caplog.text
    assert "SECRET-MARKER" not in recorder.rejections[0].reason
    # A bad key file is named as such.
    (tmp_path / "tenants.json").write_text(dump_json(table("a")))
    (tmp_path / "keys.json").write_text('{"salt_key_hex": "SECRET-MARKER", "key_hashes": {}}')
    assert watcher.poll() is None
    assert recorder.rejections[-1].file is ConfigFile.KEY_FILE and watcher.failures == 2
    assert "SECRET-MARKER" not in caplog.text
    # Fixed: the next poll loads the new pair.
    (tmp_path / "keys.json").write_text(dump_json(keys("a", "c")))
    config = watcher.poll()
    assert config is not None and set(config.keys.key_hashes) == {"a", "c"}
    assert watcher.current == config


def test_a_missing_file_is_reported_once_and_its_return_is_a_change(tmp_path: Path) -> None:
    write(tmp_path, table("a"), keys("a"))
    watcher, recorder = watcher_on(tmp_path)
    good = watcher.load()
    (tmp_path / "tenants.json").unlink()
    assert file_signature(tmp_path / "tenants.json") is None
    assert watcher.poll() is None and watcher.poll() is None
    assert len(recorder.rejections) == 1 and "FileNotFoundError" in recorder.rejections[0].reason
    assert watcher.current == good
    (tmp_path / "tenants.json").write_text(dump_json(table("a", "z")))
    config = watcher.poll()
    assert config is not None and set(config.table.tenants) == {"a", "z"}


def test_poll_async_runs_the_same_poll(tmp_path: Path) -> None:
    write(tmp_path, table("a"), keys("a"))
    watcher, _ = watcher_on(tmp_path)
    watcher.load()
    (tmp_path / "tenants.json").write_text(dump_json(table("a", "b")))
    config = asyncio.run(watcher.poll_async())
    assert config is not None and set(config.table.tenants) == {"a", "b"}
    assert asyncio.run(watcher.poll_async()) is None


def test_a_reload_validates_only_the_changed_tenants_and_equals_a_full_load(tmp_path: Path) -> None:
    """TenantTable.reload: unchanged entries keep their objects (the gateway then leaves their gates and
    policies alone), changed and new ones are validated, removed ones go, and the result equals a full
    validation of the file."""
    write(tmp_path, table("a", "b", "c"), keys("a", "b", "c"))
    watcher, recorder = watcher_on(tmp_path)
    first = watcher.load().table
    edited = tenant_table(
        tenant_entry("a", hbm=1, hbm_burst=2),
        tenant_entry("b", hbm=1, hbm_burst=5),  # changed
        tenant_entry("d", hbm=1, hbm_burst=2),  # new; c removed
        pools=[pool_entry(hbm_blocks=100)],
    )
    (tmp_path / "tenants.json").write_text(dump_json(edited))
    set_mtime(tmp_path / "tenants.json", 1)
    config = watcher.poll()
    assert config is not None and not recorder.rejections
    second = config.table
    assert second == TenantTable.model_validate_json((tmp_path / "tenants.json").read_bytes())
    assert list(second.tenants) == ["a", "b", "d"]
    assert second.tenants["a"] is first.tenants["a"]  # unchanged: the same object
    assert second.tenants["b"] is not first.tenants["b"] and second.tenants["b"].quota.hbm_burst_blocks == 5
    assert config.keys is watcher.current.keys  # the key file's bytes did not change: the same object
    # A changed entry that is invalid is rejected with the full load's own error, and nothing is kept.
    bad = dump_json(edited).replace('"hbm_burst_blocks": 5', '"hbm_burst_blocks": -5')
    assert bad != dump_json(edited)
    (tmp_path / "tenants.json").write_text(bad)
    set_mtime(tmp_path / "tenants.json", 2)
    assert watcher.poll() is None
    (rejection,) = recorder.rejections
    assert (
        rejection.file is ConfigFile.TENANT_TABLE and "tenants.b.quota.hbm_burst_blocks" in rejection.reason
    )
    assert watcher.current.table is second


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1, "tenants": {"x": {"k": [1, 2.5, null, true]}, "y": {}}, "b": "s"}',
        ' \n{ "tenants" : { } , "z" : {"tenants": 3} }\n ',
        '{"tenants": 7}',
        "{}",
        '{"tenants": {"x": 1, "x": 2}}',
        '{"tenants": {"\\u00e9": "caf\\u00e9"}}',
    ],
)
def test_decoding_in_steps_agrees_with_json_loads(text: str) -> None:
    assert loads_in_steps(text, "tenants") == json.loads(text)


@pytest.mark.parametrize(
    "text", ['{"tenants": {"x": 1,}}', '{"tenants": {"x" 1}}', '{"a": 1} x', '{"tenants": {x: 1}}', '{"a": 1']
)
def test_decoding_in_steps_refuses_what_json_loads_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        loads_in_steps(text, "tenants")


def test_decoding_in_steps_agrees_on_a_large_table() -> None:
    big = tenant_table(
        *(tenant_entry(f"t{i}", hbm=1, hbm_burst=2) for i in range(1000)), pools=[pool_entry()]
    )
    text = dump_json(big)
    assert loads_in_steps(text, "tenants") == json.loads(text)
