"""dsattn.targets (the chips compiled for without one) and what scripts/aot_check.py builds on
them that needs no chip: the largest batch that fits, the program list, the report's rows."""

import pytest

from dsattn import targets
from dsattn.bench import aot


def test_the_four_targets_load_with_their_vendors_figures():
    assert set(targets.names()) >= {"h100", "h200", "v5e", "v6e"}
    h100, h200, v5e = targets.load("h100"), targets.load("h200"), targets.load("v5e")
    assert (h100.platform, v5e.platform) == ("cuda", "tpu")
    assert h100.shared_memory == h200.shared_memory == 227 * 1024  # Hopper's opt-in block
    assert h200.memory_bytes > h100.memory_bytes and v5e.shared_memory is None
    text = h100.gpu_target_config()
    for field in ("core_count: 132", "shared_memory_per_block_optin: 232448",
                  "cuda_compute_capability { major: 9 minor: 0 }", 'platform_name: "CUDA"',
                  f"device_memory_size: {h100.memory_bytes}"):
        assert field in text


def test_a_target_is_added_as_a_file(tmp_path):
    path = tmp_path / "a100.yaml"
    base = (targets.DIRECTORY / "h100.yaml").read_text()
    path.write_text(base.replace("name: h100", "name: a100")
                    .replace("shared_memory_per_block_optin: 232448",
                             "shared_memory_per_block_optin: 166912"))
    a100 = targets.load(str(path))
    assert a100.name == "a100" and a100.shared_memory == 166912
    with targets.building_for(a100):
        assert targets.shared_memory() == 166912
    assert targets.shared_memory() == 232448  # the smallest of configs/targets/ again


@pytest.mark.parametrize("text, message", [("name: x\nplatform: rocm\n", "platform must be"),
                                           ("name: x\nplatform: cuda\ncolour: 1\n",
                                            "unknown keys colour")])
def test_a_bad_target_file_is_refused(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        targets.load(str(path))
    with pytest.raises(ValueError, match="no target 'tpu9'.*h100"):
        targets.load("tpu9")


def test_the_largest_batch_is_found_from_the_compiled_peaks():
    """Linear through batch 1 and 2, checked at the estimate, then by the line through the
    largest that fits and the smallest that does not; a program whose batch 1 does not fit
    has no batch, one whose batch 2 does not has batch 1."""
    compiled = []

    def peak(b):  # 3 GiB fixed, 2 GiB a row, and 1 GiB more past 20 rows
        compiled.append(b)
        return (3 + 2 * b + (b > 20)) * 2**30

    assert aot.max_batch(peak, 45 * 2**30) == 20  # 21 rows would take 46 GiB
    assert compiled == [1, 2, 21, 20]
    assert aot.max_batch(lambda b: None if b > 1 else 10 * 2**30, 45 * 2**30) == 1
    assert aot.max_batch(lambda b: 20 * b * 2**30, 45 * 2**30) == 2
    # a TPU pads batches to 8 rows: 1 and 2 weigh the same, the estimate is far too large
    padded = lambda b: (1 + 2 * -(-b // 8) * 8) * 2**30  # noqa: E731
    assert aot.max_batch(padded, 45 * 2**30) == 16  # 17 takes 24 padded rows: 49 GiB
    assert aot.max_batch(lambda b: 50 * 2**30, 45 * 2**30) is None


def test_an_estimate_that_fits_with_room_left_is_not_the_answer():
    """Batch 2 costs more than a row past it (a decode step's temporaries step up from 1 row
    to 2: V4 at 128K on an H200 rose 0.13 GiB, then 0.107 GiB a row), so the line through 1
    and 2 stops short, and its estimate fits with memory to spare: the search goes on up
    until a batch does not fit, then narrows."""
    def peak(b):  # 1 GiB at batch 1, 1.5 at 2, then 0.25 GiB a row
        return (1 if b == 1 else 1.5 + 0.25 * (b - 2)) * 2**30

    assert 176 - 176 // 32 <= aot.max_batch(peak, 45 * 2**30) <= 176  # 176 rows: 45 GiB


def test_every_program_of_the_report():
    specs = aot.specs(["v4"], ["xla", "kernels"], aot.DEFAULT_PROGRAMS, mesh=False)
    by = {(s.impl, s.program, s.batch, s.length) for s in specs}
    assert ("kernels", "train", 4, 8192) in by and ("xla", "train_long", 1, 32768) in by
    assert {("xla", "decode", 1, 32768), ("xla", "decode", 1, 131072)} <= by
    assert ("kernels", "serve", aot.SERVE_ROWS, aot.SERVE_CONTEXT) in by
    assert len({s.key for s in specs}) == len(specs)
    # on 8 chips every chip holds rows of its own
    on_mesh = {(s.program, s.batch, s.length) for s in aot.specs(
        ["v4"], ["xla"], ["train", "decode"], mesh=True, chips=8)}
    assert on_mesh == {("train", 8, 8192), ("decode", 8, 32768), ("decode", 8, 131072)}
    with pytest.raises(ValueError, match="unknown program 'fly'"):
        aot.specs(["v4"], ["xla"], ["fly"], mesh=False)


def test_a_refused_batch_never_fits_the_search():
    """libtpu names only the temporaries it asked for, and refuses them against its own
    limit: on a v6e 31.33 GiB of temporaries were refused (31.25 available) though that is
    below the target's usable bytes, and the search took the refusal for a batch that fits."""
    usable = 31.36 * 2**30
    refused = {"compiled": False, "fits": False, "asked_bytes": int(31.33 * 2**30)}
    assert aot.search_weight(refused, usable) > usable
    assert aot.search_weight({"compiled": False, "fits": False,
                              "asked_bytes": 40 * 2**30}, usable) == 40 * 2**30
    assert aot.search_weight({"compiled": False, "error": "smem"}, usable) is None
    assert aot.search_weight({"compiled": True, "peak_bytes": 7}, usable) == 7

    def peak(b):  # refused from 824 rows on, each asking less than `usable`
        row = ({"compiled": False, "fits": False, "asked_bytes": int(31.3 * 2**30)}
               if b >= 824 else {"compiled": True, "peak_bytes": int((0.3 + 0.0377 * b) * 2**30)})
        return aot.search_weight(row, usable)

    assert 823 - 823 // 32 <= aot.max_batch(peak, usable) < 824


def test_the_table_shows_a_mesh_row_at_its_rows_per_chip():
    """On a mesh the programs take a row per chip at least (8 x 8192 training tokens on 8
    GPUs, 8 decode rows): the table's cells show those rows, not only batch-1 ones."""
    def row(program, batch, length, peak, chips):
        return {"mesh": "1x1x8" if chips > 1 else "1 chip", "chips": chips, "preset": "v4",
                "impl": "xla", "program": program, "batch": batch, "length": length,
                "compiled": True, "fits": True, "peak_bytes": peak * 2**30,
                "kernels": {"per_layer": 50.0}}

    text = aot.table([row("train", 8, 8192, 3.5, 8), row("decode", 8, 32768, 0.25, 8),
                      row("train", 4, 8192, 14.0, 1), row("decode", 1, 32768, 0.27, 1)])
    one, mesh = [line for line in text.splitlines() if "| v4 |" in line]
    assert one.split(" | ")[3:7] == ["14.00", "", "", "0.27"]
    assert mesh.split(" | ")[3:7] == ["3.50", "", "", "0.25"]
    assert mesh.split(" | ")[-2] == "50.0"
