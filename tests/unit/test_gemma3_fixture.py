"""The Gemma 3 270M fixture (tests/helpers/gemma3_model.py): the GGUF is the parts concatenated in order and only a
file whose sha256 is the manifest package's EXPECTED_SHA256 is kept; set-up builds the HF directory from it."""

import hashlib
import os

import pytest
from helpers import gemma3_model


def _parts(tmp_path, chunks):
    paths = []
    for i, chunk in enumerate(chunks):
        path = tmp_path / f"model.gguf.part{i:02d}"
        path.write_bytes(chunk)
        paths.append(str(path))
    return paths


def test_parts_are_concatenated_in_order_under_the_manifest_digest(tmp_path):
    chunks = [b"GGUF", b"-first-", b"second", b"!"]
    manifest = tmp_path / "__init__.py"
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    manifest.write_text(f'MODEL_NAME = "m.gguf"\nEXPECTED_SHA256 = "{digest}"\n')
    out = tmp_path / "out" / "m.gguf"
    assert gemma3_model.assemble(_parts(tmp_path, chunks), str(out), gemma3_model.expected_sha256(str(manifest))) \
        == str(out)
    assert out.read_bytes() == b"".join(chunks)


def test_a_wrong_digest_leaves_no_file(tmp_path):
    chunks = [b"GGUF", b"-first-", b"second"]
    out = tmp_path / "m.gguf"
    swapped = _parts(tmp_path, chunks)
    swapped[1], swapped[2] = swapped[2], swapped[1]  # parts out of order: another file
    with pytest.raises(gemma3_model.FixtureError, match="expected sha256"):
        gemma3_model.assemble(swapped, str(out), hashlib.sha256(b"".join(chunks)).hexdigest())
    assert not out.exists()
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_a_manifest_without_a_digest_is_refused(tmp_path):
    manifest = tmp_path / "__init__.py"
    manifest.write_text('EXPECTED_SHA256 = "not-hex"\n')
    with pytest.raises(gemma3_model.FixtureError, match="EXPECTED_SHA256"):
        gemma3_model.expected_sha256(str(manifest))


def test_set_up_builds_the_directory():
    with open(os.path.join(gemma3_model.REPO, "launch", "setup_env.sh")) as f:
        setup = f.read()
    assert "install_gemma3\n" in setup and "tests/helpers/gemma3_model.py" in setup
    assert all(p.split("==")[0] in setup for p in gemma3_model.PACKAGES[:1])
