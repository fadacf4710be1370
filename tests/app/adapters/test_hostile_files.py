"""Hostile adapter files under an allowed root: each is refused with a 4xx error, quickly, without reading the
file into memory, and the process stays responsive."""

from __future__ import annotations

import json
import resource
import struct
import time

import pytest
import torch

from adapter_helpers import edit_config, edit_tensors, good, make_adapter, registry, root  # noqa: F401 (fixtures)
from app.adapters import safetensors_file
from app.adapters.registry import CONFIG_NAME, WEIGHTS_NAME
from app.errors import AdapterFormatError, AdapterInvalid, AdapterNonFinite, ServingError


def _status(error: ServingError) -> int:
    return error.status_code


def test_home_directory_of_no_such_user(registry, good):
    with pytest.raises(AdapterFormatError, match="cannot expand") as caught:
        registry.validate("a", "~nosuchuser_zz/good")
    assert _status(caught.value) == 400


def test_float8_weights_are_refused_by_dtype(registry, good):
    edit_tensors(good, lambda t: t.update({k: v.to(torch.float8_e4m3fn) for k, v in t.items()}))
    with pytest.raises(AdapterFormatError, match="float8_e4m3fn; adapters are served from float32"):
        registry.validate("a", good)


def _write_header(path, header_bytes: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes)


def test_safetensors_header_nested_too_deeply(registry, good):
    _write_header(good / WEIGHTS_NAME, b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(AdapterFormatError, match="nests too deeply"):
        registry.validate("a", good)


def test_config_nested_too_deeply(registry, good):
    (good / CONFIG_NAME).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AdapterFormatError, match="nests too deeply"):
        registry.validate("a", good)


@pytest.mark.parametrize("alpha", [float("inf"), float("nan"), 1e38, -1e38, "16", True])
def test_absurd_or_non_numeric_lora_alpha(registry, good, alpha):
    config = json.loads((good / CONFIG_NAME).read_text())
    config["lora_alpha"] = alpha
    (good / CONFIG_NAME).write_text(json.dumps(config))  # json writes Infinity / NaN, which Python reads back
    with pytest.raises(AdapterInvalid, match="lora_alpha") as caught:
        registry.validate("a", good)
    assert _status(caught.value) == 400


def test_absurd_alpha_pattern_value(registry, good):
    edit_config(good, alpha_pattern={"v_proj": 1e30})
    with pytest.raises(AdapterInvalid, match="scales .*v_proj"):
        registry.validate("a", good)


@pytest.mark.parametrize("content, echoed", [
    (b"top secret data", str(int.from_bytes(b"top secr", "little"))),  # the header size its first bytes decode to
    (struct.pack("<Q", 8) + b"\xffsecret\xfe", "0xff"),  # not UTF-8: the codec's message quotes the byte
    (struct.pack("<Q", 40) + b'{"k": {"dtype": "SECRET", "shape": [1]}}', "SECRET"),  # a malformed entry
], ids=["header-size", "not-utf8", "entry"])
def test_errors_never_echo_the_files_bytes(registry, good, content, echoed):
    (good / WEIGHTS_NAME).write_bytes(content)
    with pytest.raises(AdapterFormatError, match="not readable safetensors") as caught:
        registry.validate("a", good)
    assert echoed not in caught.value.message and f"{len(content)}-byte" not in caught.value.message


# The bounds below are on this process's CPU time: make test runs these tests at the lowest priority beside the
# cluster lane, where wall time stretches with the other lane's load.


def test_padded_file_is_refused_from_its_header(registry, good):
    """A valid adapter padded to just under max_adapter_bytes (a sparse file): refused from the header and the
    declared sizes, in milliseconds and without reading the padding."""
    weights = good / WEIGHTS_NAME
    with open(weights, "r+b") as f:
        f.truncate(registry.max_adapter_bytes - 1)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    with pytest.raises(AdapterFormatError, match="padded"):
        registry.validate("a", good)
    assert time.process_time() - start < 0.5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100 * 1024  # KiB: < 100 MB


def test_values_are_checked_in_bounded_chunks(registry, root, monkeypatch):
    """The NaN/Inf scan streams the file: a bad value in the last chunk of a tensor is still found."""
    make_adapter(root / "big", r=16, lora_alpha=16)
    monkeypatch.setattr(safetensors_file, "_FINITE_CHUNK_BYTES", 256)
    assert registry.validate("ok", root / "big").rank == 16

    def poison_last(tensors):
        key = sorted(k for k in tensors if "lora_B" in k)[-1]
        tensors[key].view(-1)[-1] = float("inf")

    edit_tensors(root / "big", poison_last)
    with pytest.raises(AdapterNonFinite, match="1 NaN/Inf values"):
        registry.validate("bad", root / "big")


def test_catastrophic_target_modules_regex_is_bounded(registry, good):
    """`(.|.){23}y` backtracks 2**23 ways per module name in `re`; matching is bounded and the adapter refused."""
    edit_config(good, target_modules="(.|.){23}y|.*(q|k|v|o)_proj")
    start = time.process_time()
    with pytest.raises(AdapterInvalid, match="target_modules pattern .* took over") as caught:
        registry.validate("a", good)
    assert time.process_time() - start < 1.0
    assert _status(caught.value) == 400


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_catastrophic_pattern_keys_are_bounded(registry, good, field):
    edit_config(good, **{field: {"(.|.){23}y": 8}})
    start = time.process_time()
    with pytest.raises(AdapterInvalid, match=f"{field} pattern"):
        registry.validate("a", good)
    assert time.process_time() - start < 1.0


def test_invalid_regex_is_a_clear_error(registry, good):
    edit_config(good, target_modules="(q_proj")
    with pytest.raises(AdapterInvalid, match="not a valid regular expression"):
        registry.validate("a", good)
