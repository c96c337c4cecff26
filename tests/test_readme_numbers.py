"""The README's version line and headline numbers agree with their sources: pyproject.toml
for the torch versions, benchmarks/RESULTS.md for each number's commit."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
COMMIT_DATE = re.compile(r"\b([0-9a-f]{7})\b.*?\b(\d{4}-\d\d-\d\d)\b")


def _headline_rows() -> list[list[str]]:
    section = README.split("## Headline numbers")[1].split("\n## ")[0]
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in section.splitlines()
            if line.startswith("| ")]
    assert rows[0] == ["what", "result", "device", "commit, date"], rows[0]
    return rows[2:]  # below the header and its rule


def test_the_torch_line_agrees_with_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'"torch(>=[\d.]+,<[\d.]+)"', pyproject).group(1)
    tested = re.findall(r"(\d+\.\d+) \((GPU|CPU)", pyproject.split("# tested:")[1].splitlines()[0])
    line = next(line for line in README.splitlines() if line.startswith("Torch: "))
    assert f"`{declared}`" in line, f"README.md: expected torch `{declared}` as pyproject.toml says, got {line!r}"
    for version, device in tested:
        assert f"{version} ({device})" in line, f"README.md: expected 'tested on {version} ({device})', got {line!r}"


def test_every_headline_row_names_a_device_and_a_commit_of_the_results():
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    rows = _headline_rows()
    assert rows
    for what, _, device, measured in rows:
        assert re.search(r"H100|H200", device), f"{what}: expected a device, got {device!r}"
        found = COMMIT_DATE.findall(measured)
        assert found, f"{what}: expected 'commit, date' in the last column, got {measured!r}"
        for commit in re.findall(r"\b[0-9a-f]{7}\b", measured):
            assert commit in results, f"{what}: expected commit {commit} in benchmarks/RESULTS.md"
