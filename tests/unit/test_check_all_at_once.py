"""``trainyard check`` reports every error of every file at once: a field error does not hide the cross-field
errors of its file (even where the broken field is required), and one bad file does not stop the others."""

from __future__ import annotations

from pathlib import Path

from check_specs import text, write

from trainyard.spec import check_files


def test_a_broken_required_field_does_not_hide_the_other_checks(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "p.yaml",
        nodes="{count: 2, min: 3}",
        training="{max_steps: lots, global_batch: 7, micro_batch: 2, checkpoint_every: 5}",
    )
    found = [line.removeprefix(f"{path}: ") for line in check_files([path])]
    assert found == [
        "training.max_steps: input should be a valid integer, unable to parse string as an integer (got 'lots')",
        "nodes.min: 3 must be <= nodes.count (2)",
        "training.global_batch: 7 must be divisible by training.micro_batch x nodes.count x nodes.procs_per_node"
        " (2 x 2 x 1 = 4)",
    ]


def test_a_missing_required_field_and_a_typo_still_check_the_rest(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yaml", nodes="{cuont: 2}", schedule="'61 * * * *'", params="[nodes, nodes]")
    found = [line.removeprefix(f"{path}: ") for line in check_files([path])]
    assert found[0] == "nodes.count: required field is missing"
    assert found[1].startswith("nodes.cuont: unknown field (did you mean 'count'?)")
    assert found[2].startswith("schedule: '61 * * * *' is not a cron expression")
    assert found[3] == "params[1]: 'nodes' is listed twice"
    # A check reading the stand-in count (global_batch vs nodes.count) is not run: its answer would be invented.
    assert len(found) == 4, found


def test_a_missing_section_still_checks_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text().replace("nodes: {count: 2}\n", "") + "params: [lr]\n")
    found = [line.removeprefix(f"{path}: ") for line in check_files([path])]
    assert found[0] == "nodes: required field is missing"
    assert any(f.startswith("params[0]: 'lr' overrides training.args.lr") for f in found), found


def test_every_file_is_reported_not_only_the_first(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", nodes="{count: 0}", dataset='{source: "file:///a", name: a}')
    write(tmp_path, "b.yaml", schedule="'@sometimes'", dataset='{source: "file:///b", name: b}')
    write(tmp_path, "c.yaml", dataset='{source: "file:///c", name: c}')
    found = check_files([tmp_path])
    assert [Path(line.split(":")[0]).name for line in found] == ["a.yaml", "b.yaml"], found
