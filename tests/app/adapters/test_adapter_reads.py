"""Reading a registered adapter's weights: as PEFT holds them, packed into pages, from odd files, and after
its files vanish or rot."""

from __future__ import annotations

import json
import os

import pytest
import torch

from adapter_helpers import ATTN, BASE, edit_tensors, make_adapter, registry, root  # noqa: F401 (fixtures)
from app.adapters.safetensors_file import WEIGHTS_NAME, read_adapter_file
from app.adapters.spec import load_weights, read_adapter
from app.errors import AdapterLoadFailed, AdapterNonFinite
from app.adapters.targets import target_shapes
from prefetch.layout import PageLayout


def test_load_weights(registry, root):
    model = make_adapter(root / "pat", r=8, lora_alpha=16, target_modules=ATTN, rank_pattern={"v_proj": 2})
    spec = registry.register("pat", "pat")
    weights = load_weights(spec, dtype=torch.bfloat16)
    assert set(weights) == set(spec.module_ranks)
    v = weights["model.layers.1.self_attn.v_proj"]
    assert v.A.shape == (2, 64) and v.B.shape == (32, 2) and v.A.dtype == torch.bfloat16
    assert v.scale == 8.0
    peft_v = model.base_model.model.model.layers[1].self_attn.v_proj
    torch.testing.assert_close(v.B.float(), peft_v.lora_B["default"].weight.to(torch.bfloat16).float())
    assert load_weights(spec)["model.layers.0.self_attn.q_proj"].A.dtype == torch.float32


def test_packed_read_equals_reference(registry, root):
    """The engine's GIL-light path (1-D slices, one multi-tensor copy) packs what a plain per-module loop packs:
    rank row k of A and of Bᵀ in page k // page_rows at row k % page_rows, zeros past each module's rank, the
    fp32 file cast to the engine's bf16."""
    make_adapter(root / "pat", r=8, lora_alpha=16, target_modules=ATTN, rank_pattern={"v_proj": 2})
    spec = registry.register("pat", "pat")
    layout = PageLayout(target_shapes(BASE), max_rank=16, page_rows=4)
    assert layout.pages_for(spec.rank) == 2
    pages = [torch.full((layout.page_numel,), 7.0, dtype=torch.bfloat16) for _ in range(2)]  # pack clears them
    scales = layout.pack(read_adapter(spec).flat_parts(), pages)

    expected = [torch.zeros(layout.page_numel, dtype=torch.bfloat16) for _ in range(2)]
    for module, lora in load_weights(spec, dtype=torch.bfloat16).items():
        index = layout.module_index[module]
        a_seg, bt_seg = layout.segments[2 * index], layout.segments[2 * index + 1]
        for k in range(lora.A.shape[0]):
            page, row = divmod(k, 4)
            expected[page][a_seg.offset + row * a_seg.cols:][: a_seg.cols] = lora.A[k]
            expected[page][bt_seg.offset + row * bt_seg.cols:][: bt_seg.cols] = lora.B[:, k]
        assert scales[index] == lora.scale
    assert all(torch.equal(got, want) for got, want in zip(pages, expected))
    untargeted = [i for i, module in enumerate(layout.modules) if module not in spec.module_ranks]
    assert untargeted and scales[untargeted].eq(0).all()
    with pytest.raises(ValueError, match="needs 2 pages of 4 rank rows; 1 were reserved"):
        layout.pack(read_adapter(spec).flat_parts(), pages[:1])


def test_misaligned_tensors_read_by_copy(tmp_path):
    """Tensors lie back to back. The safetensors library writes the widest dtype first, but other writers
    may put a bf16 tensor of odd length before an fp32 one, whose offset is then not a multiple of 4 bytes;
    AdapterFile copies such a tensor instead of viewing it."""
    tensors = {"a": torch.arange(3, dtype=torch.bfloat16), "b": torch.randn(2, 5), "c": torch.randn(4).half()}
    header, data = {}, b""
    for key, tensor in tensors.items():
        raw = tensor.view(torch.uint8).numpy().tobytes()
        dtype = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}[tensor.dtype]
        header[key] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    (tmp_path / WEIGHTS_NAME).write_bytes(len(text).to_bytes(8, "little") + text + data)
    file = read_adapter_file("x", tmp_path / WEIGHTS_NAME)
    assert file.entries["b"].start % 4  # the case under test
    for key, tensor in tensors.items():
        assert torch.equal(file.tensor(key), tensor), key


def test_load_after_files_vanish_or_rot(registry, root):
    names = ("gone", "shrunk", "zeroed", "nan", "stays")
    for name in names:
        make_adapter(root / name, r=4)
    specs = {name: registry.register(name, name) for name in names}
    os.remove(root / "gone" / WEIGHTS_NAME)
    (root / "shrunk" / WEIGHTS_NAME).write_bytes(b"garbage")
    (root / "zeroed" / WEIGHTS_NAME).write_bytes(bytes(specs["zeroed"].nbytes))  # same size, no header
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    edit_tensors(root / "nan", lambda t: t[key].view(-1).__setitem__(0, float("inf")))
    assert (root / "nan" / WEIGHTS_NAME).stat().st_size == specs["nan"].nbytes

    with pytest.raises(AdapterLoadFailed, match="'gone': cannot read .*No such file") as info:
        load_weights(specs["gone"])
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(AdapterLoadFailed, match=r"'shrunk'.*since registration \(\d+ bytes then, 7 now\)"):
        load_weights(specs["shrunk"])
    with pytest.raises(AdapterLoadFailed, match="'zeroed'.*not readable safetensors.*re-register it"):
        load_weights(specs["zeroed"])
    with pytest.raises(AdapterLoadFailed, match="'nan'.*NaN/Inf") as info:
        load_weights(specs["nan"])
    assert isinstance(info.value.__cause__, AdapterNonFinite)
    assert len(load_weights(specs["stays"])) == 4
