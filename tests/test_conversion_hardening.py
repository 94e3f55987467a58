"""The converter under hostile conditions: a DST that appears mid-run, NaN / Inf weights, malformed
files, a full disk, a read-only destination, a file in the way.

Every refusal is a `DeepseekV41ConversionError` (rc 2 on the command line) that names the file,
tensor or key, and leaves nothing behind: no DST, no partial folder, no parent folder the run made.
Sources are copies of the golden tiny fp8 checkpoint (one unsharded file, flat config) and of a
make-tiny checkpoint (shards with an index, nested config).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

from deepseek_v41_vl.cli import main
from deepseek_v41_vl.conversion import convert as convert_module
from deepseek_v41_vl.conversion import make_tiny as make_tiny_module
from deepseek_v41_vl.conversion import staging
from deepseek_v41_vl.conversion.convert import convert_checkpoint
from deepseek_v41_vl.conversion.make_tiny import make_tiny, nested_config
from deepseek_v41_vl.modeling.checkpoint_names_deepseek_v41_vl import DeepseekV41ConversionError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "official", seed=3, variant="fp8")


def _copy(folder: Path, dst: Path) -> Path:
    """A writable copy of a (possibly read-only) folder."""
    shutil.copytree(folder, dst, copy_function=shutil.copyfile)
    return dst


def _link_copy(folder: Path, dst: Path) -> Path:
    """`folder` with every file symlinked (for sources whose JSON files a test rewrites)."""
    dst.mkdir(parents=True)
    for path in folder.iterdir():
        if path.is_dir():
            _link_copy(path, dst / path.name)
        else:
            (dst / path.name).symlink_to(path.resolve())
    return dst


def _rewrite_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.unlink()  # it may be a symlink into the shared source
    path.write_text(json.dumps(data))


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _rewrite_header(path: Path, change) -> None:
    """Change the header of a safetensors file in place (same length, padded with spaces)."""
    n, header = _header(path)
    change(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    assert len(blob) <= n
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(blob + b" " * (n - len(blob)))


def _poke(path: Path, name: str, element: int, code: bytes) -> None:
    """Overwrite element `element` of tensor `name` with the raw bytes `code`."""
    n, header = _header(path)
    begin = header[name]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(8 + n + begin + element * len(code))
        f.write(code)


def _nothing_left(parent: Path, before: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == before


def _refused(src: Path, dst: Path, match: str, **kwargs) -> DeepseekV41ConversionError:
    before = {p.name for p in dst.parent.iterdir()} if dst.parent.is_dir() else None
    with pytest.raises(DeepseekV41ConversionError, match=match) as info:
        convert_checkpoint(src, dst, progress=False, **kwargs)
    assert not dst.exists() and not dst.is_symlink()
    if before is not None:
        _nothing_left(dst.parent, before)
    return info.value


# --------------------------------------------------------------------------------------------
# 1. A DST that appears while the conversion runs is never replaced without --force
# --------------------------------------------------------------------------------------------


def _appearing(dst: Path, with_file: bool):
    """Create `dst` (with a user's file, or empty), as someone else would in the middle of a run."""

    def appear() -> None:
        dst.mkdir()
        if with_file:
            (dst / "mine.txt").write_text("precious")

    return appear


@pytest.mark.parametrize("rename", ["default", "without renameat2"])
@pytest.mark.parametrize("with_file", [True, False], ids=["with a file", "empty"])
def test_a_destination_that_appears_mid_run_is_left_alone(golden, tmp_path, monkeypatch, with_file, rename):
    if rename == "without renameat2":  # another system, or a file system refusing it: the mkdir claim
        monkeypatch.setattr(staging, "_renameat2", lambda: None, raising=False)
    dst = tmp_path / "out"
    appear = _appearing(dst, with_file)
    real = convert_module.bundle_remote_code

    def bundle_then_appear(folder):
        real(folder)
        appear()

    monkeypatch.setattr(convert_module, "bundle_remote_code", bundle_then_appear)
    with pytest.raises(DeepseekV41ConversionError, match=f"destination {re.escape(str(dst))} appeared while the conversion ran"):
        convert_checkpoint(golden / "model_tiny_fp8", dst, progress=False)
    assert sorted(p.name for p in dst.iterdir()) == (["mine.txt"] if with_file else [])
    if with_file:
        assert (dst / "mine.txt").read_text() == "precious"
    _nothing_left(tmp_path, {"out"})
    # with --force the appeared folder is replaced, as an existing one is
    monkeypatch.setattr(convert_module, "bundle_remote_code", real)
    convert_checkpoint(golden / "model_tiny_fp8", dst, force=True, progress=False)
    assert (dst / "config.json").is_file() and not (dst / "mine.txt").exists()
    _nothing_left(tmp_path, {"out"})


def test_make_tiny_does_not_replace_a_destination_that_appears(tmp_path, monkeypatch):
    dst = tmp_path / "tiny"
    real = make_tiny_module.write_shards

    def write_then_appear(*args, **kwargs):
        files = real(*args, **kwargs)
        _appearing(dst, True)()
        return files

    monkeypatch.setattr(make_tiny_module, "write_shards", write_then_appear)
    with pytest.raises(DeepseekV41ConversionError, match="appeared while the conversion ran"):
        make_tiny(dst)
    assert [p.name for p in dst.iterdir()] == ["mine.txt"]
    _nothing_left(tmp_path, {"tiny"})


@pytest.mark.parametrize("rename", ["renameat2", "mkdir claim"])
def test_rename_noreplace_refuses_every_kind_of_destination(tmp_path, monkeypatch, rename):
    if rename == "mkdir claim":
        monkeypatch.setattr(staging, "_renameat2", lambda: None)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("new")
    targets = {"empty": tmp_path / "empty", "full": tmp_path / "full", "file": tmp_path / "file", "link": tmp_path / "link"}
    targets["empty"].mkdir()
    targets["full"].mkdir()
    (targets["full"] / "b").write_text("old")
    targets["file"].write_text("old")
    targets["link"].symlink_to(tmp_path / "nowhere")
    for kind, target in targets.items():
        with pytest.raises(FileExistsError):
            staging.rename_noreplace(src, target)
        assert (src / "a").read_text() == "new", kind
    assert [p.name for p in targets["empty"].iterdir()] == [] and (targets["full"] / "b").read_text() == "old"
    assert targets["file"].read_text() == "old" and targets["link"].is_symlink()
    staging.rename_noreplace(src, tmp_path / "fresh")
    assert (tmp_path / "fresh" / "a").read_text() == "new" and not src.exists()


# --------------------------------------------------------------------------------------------
# 3. NaN / Inf weights are refused in every mode, naming the tensor
# --------------------------------------------------------------------------------------------


def test_first_nonfinite_matches_torch_for_every_code():
    from deepseek_v41_vl.conversion.nonfinite import first_nonfinite

    cases = {
        "BF16": (torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16), torch.bfloat16),
        "F16": (torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16), torch.float16),
        "F8_E4M3": (torch.arange(256, dtype=torch.int32).to(torch.uint8), torch.float8_e4m3fn),
        "F8_E5M2": (torch.arange(256, dtype=torch.int32).to(torch.uint8), torch.float8_e5m2),
        "F8_E8M0": (torch.arange(256, dtype=torch.int32).to(torch.uint8), torch.float8_e8m0fnu),
    }
    for dtype, (codes, torch_dtype) in cases.items():
        finite = torch.isfinite(codes.view(torch_dtype).float())
        if dtype == "F8_E8M0":  # scales of 2^120 and up are refused too: 448 x 2^120 overflows
            finite &= codes.view(torch_dtype).float() < 2.0**120
        assert not finite.all(), dtype
        assert first_nonfinite(codes[finite], dtype) is None, dtype
        for code in codes[~finite]:
            assert first_nonfinite(code.reshape(1), dtype) == 0, (dtype, code)
        assert first_nonfinite(codes, dtype) == int((~finite).nonzero()[0, 0])
    # F32: a few codes each side of the exponent boundary
    values = torch.tensor([0.0, -1.0, 3.4e38, float("inf"), float("-inf"), float("nan"), 1e-45])
    assert first_nonfinite(values, "F32") == 3 and first_nonfinite(values[:3], "F32") is None
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert first_nonfinite(packed, "I8") is None  # fp4 pairs and integers have no NaN code


# (tensor, element, raw code, where the message places it)
CORRUPTIONS = {
    "head.weight NaN": ("head.weight", 3 * 256 + 5, b"\xc0\x7f", r"(element 773|\[3, 5\])"),
    "embed.weight -Inf": ("embed.weight", 7, b"\x80\xff", r"element 7"),
    "fp8 weight NaN code": ("layers.3.attn.wq_a.weight", 2 * 256 + 40, b"\x7f", r"(element 552|\[2, 40\])"),
    "e8m0 scale 0xFF": ("layers.3.attn.wq_a.scale", 8 + 3, b"\xff", r"(element 11|\[1, 3\])"),
    "fp4 expert scale 0xFF": ("layers.2.ffn.experts.0.w1.scale", 5 * 8 + 2, b"\xff", r"(element 42|\[5, 2\])"),
}
MODES = {"default": {}, "bf16": {"dtype": "bf16"}, "link": {"link": True}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_nan_or_inf_weight_is_refused_before_anything_is_published(golden, tmp_path, case, mode):
    name, element, code, position = CORRUPTIONS[case]
    src = _copy(golden / "model_tiny_fp8", tmp_path / "src")
    _poke(src / SINGLE, name, element, code)
    error = _refused(src, tmp_path / "dst", rf"tensor '{re.escape(name)}' in .*model\.safetensors holds ", verify=True, **MODES[mode])
    message = str(error)
    assert re.search(position, message), message
    assert ("an e8m0 scale of 0xF7 or more" in message) == name.endswith(".scale")
    assert ("e4m3 NaN code" in message) == ("F8_E4M3" in message)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("code", [b"\xf7", b"\xfe"])
def test_a_finite_scale_whose_weights_overflow_is_refused(golden, tmp_path, mode, code):
    # 2^120 (0xF7) and up: 448, the largest e4m3 value, times the scale is past fp32 / bf16, and
    # every logit of a model with it is NaN
    src = _copy(golden / "model_tiny_fp8", tmp_path / "src")
    _poke(src / SINGLE, "layers.3.attn.wq_a.weight", 0, b"\x7e")  # 448
    _poke(src / SINGLE, "layers.3.attn.wq_a.scale", 0, code)
    _refused(src, tmp_path / "dst", r"tensor 'layers\.3\.attn\.wq_a\.scale' .* holds an e8m0 scale of 0xF7 or more .*"
             rf"\(0x{code.hex()}, F8_E8M0\) at (\[0, 0\]|element 0)", verify=True, **MODES[mode])


def test_the_largest_scale_allowed_converts(golden, tmp_path):
    # 2^119 (0xF6): 448 x 2^119 is still a finite bf16, so the bf16 conversion writes it
    src = _copy(golden / "model_tiny_fp8", tmp_path / "src")
    _poke(src / SINGLE, "layers.3.attn.wq_a.weight", 0, b"\x7e")
    _poke(src / SINGLE, "layers.3.attn.wq_a.scale", 0, b"\xf6")
    convert_checkpoint(src, tmp_path / "dst", dtype="bf16")


def test_the_cli_refuses_a_nan_checkpoint_with_rc_2(golden, tmp_path, capsys):
    src = _copy(golden / "model_tiny_fp8", tmp_path / "src")
    _poke(src / SINGLE, "head.weight", 0, b"\xc0\x7f")
    assert main(["convert", str(src), str(tmp_path / "dst"), "--quiet", "--link"]) == 2
    assert "tensor 'head.weight'" in capsys.readouterr().err
    _nothing_left(tmp_path, {"src"})


# --------------------------------------------------------------------------------------------
# 6. Malformed files and failing writes: rc 2 with a message, nothing written
# --------------------------------------------------------------------------------------------

HEADER_DAMAGE = {
    "data_offsets strings": (lambda e: e.update(data_offsets=[str(o) for o in e["data_offsets"]]), "data_offsets"),
    "data_offsets floats": (lambda e: e.update(data_offsets=[float(o) for o in e["data_offsets"]]), "data_offsets"),
    "dtype a list": (lambda e: e.update(dtype=[e["dtype"]]), "unsupported dtype"),
    "shape strings": (lambda e: e.update(shape=[str(d) for d in e["shape"]]), "shape"),
}


@pytest.mark.parametrize("damage", list(HEADER_DAMAGE))
def test_a_header_field_of_the_wrong_type(golden, tmp_path, damage):
    change, what = HEADER_DAMAGE[damage]
    src = _copy(golden / "model_tiny_fp8", tmp_path / "src")
    _rewrite_header(src / SINGLE, lambda h: change(h["head.weight"]))
    _refused(src, tmp_path / "dst", rf"model\.safetensors: .*'head\.weight'.*{what}")


@pytest.mark.parametrize("value", [3, ["model-00001-of-00002.safetensors"], None], ids=["int", "list", "null"])
def test_an_index_whose_weight_map_value_is_not_a_file_name(tiny_source, tmp_path, value):
    src = _link_copy(tiny_source, tmp_path / "src")
    _rewrite_json(src / INDEX, lambda d: d["weight_map"].update({"embed.weight": value}))
    _refused(src, tmp_path / "dst", rf"{INDEX}: weight_map\['embed\.weight'\] is {re.escape(repr(value))}, not the file name")


@pytest.mark.parametrize(
    "key, value", [("text_config", "deepseek"), ("text_config", [1, 2]), ("vision_config", 3), ("quantization_config", "fp8")]
)
def test_a_config_whose_sub_config_is_not_an_object(golden, tmp_path, key, value):
    src = _link_copy(golden / "model_tiny_fp8", tmp_path / "src")
    nested = nested_config(json.loads((golden / "model_tiny_fp8" / "config.json").read_text()))  # the released layout
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps(dict(nested, **{key: value})))
    _refused(src, tmp_path / "dst", rf"config\.json: invalid config \(DeepseekV41ConfigError: (config\.)?{key} must be a mapping")


def _failing_pwrite(after: int):
    calls = {"n": 0}
    real = os.pwrite

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    return pwrite


@pytest.mark.parametrize("mode", ["default", "bf16"])
def test_a_disk_that_fills_mid_write(golden, tmp_path, monkeypatch, mode):
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "other.txt").write_text("not the converter's")
    monkeypatch.setattr(os, "pwrite", _failing_pwrite(after=40))
    dst = keep / "new" / "deeper" / "dst"  # parents the run creates, and must remove again
    _refused(golden / "model_tiny_fp8", dst, r"\.safetensors: cannot write \(No space left on device\)", **MODES[mode])
    _nothing_left(tmp_path, {"keep"})
    _nothing_left(keep, {"other.txt"})


def test_a_disk_that_fills_while_the_small_files_are_written(golden, tmp_path, monkeypatch):
    def full(folder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "modeling_deepseek_v41_vl.py"))

    monkeypatch.setattr(convert_module, "bundle_remote_code", full)
    _refused(golden / "model_tiny_fp8", tmp_path / "dst", r"No space left on device: '.*modeling_deepseek_v41_vl\.py'")
    _nothing_left(tmp_path, set())


def _read_only(monkeypatch, folder: Path) -> None:
    """Make `folder` refuse new entries, as a read-only folder does for a non-root user."""
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        if Path(path).parent == folder:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)


@pytest.mark.parametrize("where", ["dst in it", "dst below it"])
def test_a_read_only_destination(golden, tmp_path, monkeypatch, where):
    ro = tmp_path / "ro"
    ro.mkdir()
    _read_only(monkeypatch, ro)
    dst = ro / "dst" if where == "dst in it" else ro / "sub" / "dst"
    _refused(golden / "model_tiny_fp8", dst, rf"converting into {re.escape(str(dst))} failed: .*Permission denied: '{re.escape(str(ro))}/")
    _nothing_left(ro, set())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode 0o555 folder; the monkeypatched form covers root")
def test_a_read_only_destination_by_mode(golden, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        _refused(golden / "model_tiny_fp8", ro / "dst", "Permission denied")
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0, -1.0, True, "5"])
def test_shard_and_slice_sizes_must_be_positive_and_finite(golden, tmp_path, value):
    _refused(golden / "model_tiny_fp8", tmp_path / "dst", r"max_shard_bytes must be a positive, finite number", max_shard_bytes=value)
    _refused(golden / "model_tiny_fp8", tmp_path / "dst", r"max_slice_bytes must be a positive, finite number", max_slice_bytes=value)
    with pytest.raises(DeepseekV41ConversionError, match="--max-shard-gib must be a positive, finite number"):
        convert_module.shard_bytes_from_gib(value)
    assert convert_module.shard_bytes_from_gib(0.5) == 512 * 1024**2


def test_make_tiny_and_convert_under_a_file_path(golden, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["make-tiny", str(blocker / "tiny")]) == 2
    assert f"a file is where a folder must go: '{blocker}'" in capsys.readouterr().err
    _refused(golden / "model_tiny_fp8", blocker / "sub" / "dst", rf"a file is where a folder must go: '{re.escape(str(blocker))}'")
    _nothing_left(tmp_path, {"a-file"})
    assert blocker.read_text() == "x"


# --------------------------------------------------------------------------------------------
# 7. JSON the parser cannot take, out-of-range ids, and options that do not go together:
#    rc 2 with one line naming the file, before anything is written
# --------------------------------------------------------------------------------------------

SHARD = "model-00001-of-00002.safetensors"


def _replace(path: Path, data: bytes) -> None:
    path.unlink()  # it may be a symlink into the shared source
    path.write_bytes(data)


def _safetensors_blob(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


BAD_FILES = {
    "header of 200k '['": (SHARD, _safetensors_blob(b"[" * 200_000), rf"{SHARD}: corrupt safetensors header"),
    "header nested 50k objects deep": (SHARD, _safetensors_blob(b'{"a":' * 50_000), rf"{SHARD}: corrupt safetensors header"),
    "index of 100k '['": (INDEX, b"[" * 100_000, rf"{re.escape(INDEX)}: unreadable JSON"),
    "tokenizer_config a list": ("tokenizer_config.json", b"[1]", r"tokenizer_config\.json: expected a JSON object, got list"),
    "tokenizer_config cut off": ("tokenizer_config.json", b"{", r"tokenizer_config\.json: unreadable JSON"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_file_the_json_parser_cannot_take_is_named(tiny_source, tmp_path, capsys, case):
    name, data, match = BAD_FILES[case]
    src = _link_copy(tiny_source, tmp_path / "src")
    _replace(src / name, data)
    _refused(src, tmp_path / "dst", match)
    assert main(["convert", str(src), str(tmp_path / "dst"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and re.search(match, err), err
    _nothing_left(tmp_path, {"src"})


@pytest.mark.parametrize("value", [-1, 10**12, 129280])
def test_an_image_token_id_outside_the_vocabulary_is_refused(tiny_source, tmp_path, capsys, value):
    src = _link_copy(tiny_source, tmp_path / "src")
    _rewrite_json(src / "config.json", lambda d: d.update(image_token_id=value))
    match = rf"config\.json: invalid config \(DeepseekV41ConfigError: config\.image_token_id must be a token id in \[0, vocab_size=129280\), got {value}"
    _refused(src, tmp_path / "dst", match)
    assert main(["convert", str(src), str(tmp_path / "dst"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and re.search(match, err), err


def test_link_with_a_dtype_is_refused_up_front(tiny_source, tmp_path, capsys, monkeypatch):
    def no_read(*args, **kwargs):
        raise AssertionError("the source was read")

    monkeypatch.setattr(convert_module, "load_source", no_read)
    _refused(tiny_source, tmp_path / "dst", r"link=True cannot be combined with dtype='bf16'", link=True, dtype="bf16")
    assert main(["convert", str(tiny_source), str(tmp_path / "dst"), "--link", "--dtype", "bf16", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "keeps the source storage" in err
    _nothing_left(tmp_path, set())
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "cannot be combined with --dtype" in " ".join(capsys.readouterr().out.split())
