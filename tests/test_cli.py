import json

import pytest

from paged_attention.cli.figures import notebook_paths
from paged_attention.cli.main import main
from paged_attention.memory.allocator import BlockAllocator
from paged_attention.memory.page_table import PageTable
from paged_attention.viz.memory_map import format_memory_map


def test_walkthrough_shows_fork_copy_on_write_and_frees_everything(capsys):
    assert main(["walkthrough"]) == 0
    out = capsys.readouterr().out
    assert "copy-on-write: block" in out
    assert "read its keys back through its page table: OK" in out
    assert "16/16 blocks free again" in out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_walkthrough_runs_for_other_seeds(seed, capsys):
    assert main(["walkthrough", "--seed", str(seed)]) == 0
    assert "blocks free again" in capsys.readouterr().out


def test_demo_serves_a_batch_under_a_small_budget(capsys):
    assert (
        main(["demo", "--model", "tiny", "--requests", "6", "--num-kv-blocks", "32", "--block-size", "8"])
        == 0
    )
    out = capsys.readouterr().out
    assert "served 6 requests" in out and "preemptions:" in out
    assert "every block is free again: True" in out


def test_generate_streams_one_completion(capsys):
    assert main(["generate", "--prompt", "Paged memory", "--max-tokens", "5", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Paged memory") and "[length: 5 tokens]" in out


def test_bench_allocator_prints_a_table_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "alloc.json"
    main(
        [
            "bench",
            "allocator",
            "--sizes",
            "64",
            "4096",
            "--pairs",
            "3000",
            "--repeats",
            "1",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert "pairs/s" in out and "cost per pair at 4,096 blocks" in out
    rows = json.loads(out_json.read_text())
    assert {(r["num_blocks"], r["workload"]) for r in rows} == {
        (n, w) for n in (64, 4096) for w in ("ordered", "scrambled", "mixed")
    }
    assert all(r["pairs_per_second"] > 0 for r in rows)


def test_unknown_arguments_are_rejected():
    with pytest.raises(SystemExit):
        main(["demo", "--nope"])
    with pytest.raises(SystemExit):
        main(["bench", "nothing"])


def test_figures_command_finds_the_numbered_notebooks():
    names = [p.name for p in notebook_paths()]
    assert names[:2] == ["01_kv_cache.ipynb", "02_allocator_and_page_table.ipynb"]


def test_memory_map_marks_tokens_tails_shared_and_free():
    alloc = BlockAllocator(4)
    a = PageTable(alloc, 4)
    a.append_tokens(6)
    b = a.fork()
    c = PageTable(alloc, 4)
    c.append_tokens(1)
    assert format_memory_map(alloc, [a, b, c], 4) == "   0 |****|**aa|Cccc|....|"
    with pytest.raises(ValueError, match="one single character per page table"):
        format_memory_map(alloc, [a], 4, labels=["AB"])


def test_bench_kernel_smoke_run_on_cpu(tmp_path, capsys):
    main(["bench", "kernel", "--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "smoke run" in out
    passed, total = json.loads((tmp_path / "kernel_bandwidth.json").read_text())["correct"]
    assert passed == total > 0
    rows = json.loads((tmp_path / "kernel_bandwidth.json").read_text())["rows"]
    assert {r["method"] for r in rows} >= {"paged", "contiguous", "sdpa"}
    assert (tmp_path / "kernel_bandwidth.png").stat().st_size > 0
    # A stored run (a GPU machine's) redrawn here: the same table, nothing measured, the JSON untouched.
    stored = (tmp_path / "kernel_bandwidth.json").read_text()
    redrawn = tmp_path / "redrawn"
    main(["bench", "kernel", "--from-json", str(tmp_path / "kernel_bandwidth.json"), "--out", str(redrawn)])
    again = capsys.readouterr().out
    table = out[out.index(" batch  context") : out.index("wrote")]
    assert table in again and f"{passed}/{total}" in again
    assert (redrawn / "kernel_bandwidth.png").stat().st_size > 0
    assert (tmp_path / "kernel_bandwidth.json").read_text() == stored


def test_bench_sharing_small_run_writes_both_figures(tmp_path, capsys):
    main(["bench", "sharing", "--requests", "2", "--traces", "alpaca", "--widths", "2", "--prefix-requests",
          "6", "--budget-requests", "2", "--repeats", "1", "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert "beam" in out and "1-shot (80)" in out and "5-shot (341)" in out
    for name in ("sharing_memory", "sharing_prefix"):
        assert (tmp_path / f"{name}.png").exists()
    payload = json.loads((tmp_path / "sharing_prefix.json").read_text())
    assert all(r["same_outputs"] and r["on"]["hit_rate"] > 0.5 for r in payload["results"].values())
    memory = json.loads((tmp_path / "sharing_memory.json").read_text())
    assert 0 < memory["savings"]["alpaca"]["parallel"][0] < memory["savings"]["alpaca"]["beam"][0] < 1
