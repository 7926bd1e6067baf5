"""The README's code, every docs page's code and every example run as written, and do what they say.

Each runs in its own Python process, as a user would start it. README and
docs blocks run with the fixture checkpoints in place of their placeholder
paths; that substitution is the only change. In docs/, ```python blocks
run (a page's blocks in order as one script) and ```py blocks are excerpts
of a file the tests run, named on their first line, each of their lines
found in it. Code that calls a plain `ray.init()`
joins this session's cluster through `RAY_ADDRESS`, as it would join a
user's running cluster (a cluster start saved per example); examples that
take a cluster address (the demo among them) get that cluster.
"""

from __future__ import annotations

import ast
import re

import pytest

from fixtures import NEW_TOKENS, expected_continuation, model_dir
from tests.support.scripts import REPO, run_python

PLACEHOLDERS = {
    "path/to/hf_checkpoint": str(model_dir(True, "bf16")),
    "path/to/fp8_block_checkpoint": str(model_dir(True, "fp8_block")),
}


def python_blocks(path, fence: str = "python") -> list[str]:
    return re.findall(rf"```{fence}\n(.*?)```", path.read_text(), flags=re.DOTALL)


def readme_python_blocks() -> list[str]:
    return python_blocks(REPO / "README.md")


def runnable_script(blocks: list[str]) -> str:
    code = "\n".join(blocks)
    for placeholder, path in PLACEHOLDERS.items():
        code = code.replace(placeholder, path)
    return code


DOCS = sorted((REPO / "docs").glob("*.md"))

# What each docs page's code must print (regexes, multiline): a page with ```python blocks needs an entry.
DOCS_PRINT = {
    "configuration.md": [
        r"^config: collective probe auto auto wait$",
        r"^deadline 120 s, an orphaned update closes itself after 360 s$",
        r"verify='strict': expected one of \['off', 'checksums', 'probe'\]",
        r"bucket_bytes=0: expected a positive int",
    ],
    "delta.md": [  # the first sync sends everything, the later ones only what changed; the replica holds the trainer's version
        r"^step 0: v\d+ full, received [\d.]+ MiB of [\d.]+ MiB, digest True$",
        r"^step 1: v\d+ delta, received [\d.]+ MiB of [\d.]+ MiB, digest True$",
        r"^step 2: v\d+ delta, received [\d.]+ MiB of [\d.]+ MiB, digest True$",
    ],
}


def printed_tokens(out: str, label: str) -> list[list[int]]:
    return [ast.literal_eval(line.split(":", 1)[1].strip()) for line in out.splitlines() if line.startswith(label)]


def test_readme_has_python_blocks_and_each_names_only_known_placeholders():
    blocks = readme_python_blocks()
    assert blocks
    for block in blocks:
        assert set(re.findall(r'"(path/to/[^"]+)"', block)) <= set(PLACEHOLDERS)


@pytest.mark.engine
def test_the_readme_runs_as_written(tmp_path, ray_cluster):
    """Its Python blocks, in order, as one script: a reader's session, each block going on from the one before."""
    script = tmp_path / "readme.py"
    script.write_text("num_steps = 2  # the README leaves the loop's length to the reader\n"
                      + runnable_script(readme_python_blocks()))
    out = run_python([str(script)], ray_address=ray_cluster.address)
    assert "sync v1:" in out and "sync v2:" in out, out
    assert re.search(r"model\.layers\.1\.self_attn\.attn +k_scale +default +1 +1$", out, re.MULTILINE), out  # provenance
    assert "['rollout 1', 'rollout 2']" in out, out  # the fleet block: one replica joined, rollout 0 removed


def test_docs_pages_with_code_say_what_it_must_print_and_name_only_known_placeholders():
    with_code = {page.name for page in DOCS if python_blocks(page)}
    assert with_code == set(DOCS_PRINT), "a docs page with ```python blocks needs its expected output in DOCS_PRINT"
    for page in DOCS:
        for block in python_blocks(page):
            assert set(re.findall(r'"(path/to/[^"]+)"', block)) <= set(PLACEHOLDERS), page.name


def test_docs_excerpts_are_found_line_by_line_in_the_file_they_name():
    """A ```py block in docs/ quotes a file the tests run: its first line `# from PATH`, every other line
    (but `...`) found in that file, so the excerpt cannot drift from code that runs."""
    excerpts = [(page, block) for page in DOCS for block in python_blocks(page, "py")]
    assert excerpts
    for page, block in excerpts:
        first, *lines = block.splitlines()
        source = re.fullmatch(r"# from (\S+)", first)
        assert source, f"{page.name}: a ```py excerpt starts with `# from PATH`, not {first!r}"
        text = {line.strip() for line in (REPO / source[1]).read_text().splitlines()}
        missing = [line for line in lines if line.strip() not in text and line.strip() not in ("", "...")]
        assert not missing, f"{page.name}: not in {source[1]}: {missing}"


@pytest.mark.engine
@pytest.mark.parametrize("page", sorted(DOCS_PRINT))
def test_a_docs_page_runs_as_written(page, tmp_path, ray_cluster):
    """A page's Python blocks, in order, as one script, as the README's are run; it prints what the page says."""
    script = tmp_path / page.replace(".md", ".py")
    script.write_text(runnable_script(python_blocks(REPO / "docs" / page)))
    out = run_python([str(script)], ray_address=ray_cluster.address)
    for expected in DOCS_PRINT[page]:
        assert re.search(expected, out, re.MULTILINE), (expected, out)


@pytest.mark.engine
def test_quickstart_rollouts_continue_the_progression_like_the_trainer(ray_cluster):
    out = run_python(["examples/quickstart.py"], ray_address=ray_cluster.address)
    expected = expected_continuation([7, 10, 13, 16, 19, 22, 25, 28], NEW_TOKENS)
    assert printed_tokens(out, "trainer:") == [expected]
    assert printed_tokens(out, "rollout ") == [expected, expected]
    assert "sync v1:" in out


@pytest.mark.engine
def test_multinode_places_a_rollout_on_every_other_node(ray_cluster):
    out = run_python(["examples/multinode.py", "--address", ray_cluster.address, "--rollouts", "2"])
    expected = expected_continuation([100, 102, 104, 106, 108, 110, 112, 114], NEW_TOKENS)
    rollout_lines = [line for line in out.splitlines() if line.startswith("rollout ")]
    nodes = {line.split(" on node ")[1].split(":")[0] for line in rollout_lines}
    assert len(rollout_lines) == 2 and len(nodes) == 2, out
    assert printed_tokens(out, "rollout ") == [expected, expected]


ROUND = re.compile(
    r"round (\d+): v(\d+) synced in (\d+) ms \(plan \d+, begin \d+, stream \d+, finish \d+\), "
    r"[\d.]+ MiB per replica \((?:full|delta|delta/full)\); "
    r"probe (passed|BREACHED): .*\n  mean reward ([\d.]+), greedy accuracy rollout ([\d.]+) trainer ([\d.]+)(?: seed-bug ([\d.]+))?\n"
    r"  rollout 0 scales: (.*)\n  rollout 1 scales: (.*)"
)


@pytest.mark.engine
def test_rl_loop_rollouts_track_the_trainer_every_round(ray_cluster):
    # A smaller batch than the default (16 prompts x 4 samples, not 64 x 8): what this checks is that the loop runs
    # over the collective transport and its rollouts track the trainer; the demo's test checks that it learns.
    out = run_python(["examples/rl_loop.py", "--address", ray_cluster.address, "--rounds", "3", "--warmup-steps", "10",
                      "--prompts", "16", "--group", "4", "--transport", "collective"])
    rounds = ROUND.findall(out)
    assert len(rounds) == 3, out
    # The first sync sends everything; after it both replicas hold the trainer's last version, so only what changed.
    assert re.findall(r"MiB per replica \((\S+)\)", out) == ["full", "delta", "delta"], out
    versions = [int(r[1]) for r in rounds]
    assert versions == sorted(set(versions))  # one new version per round
    for _, _, _, breached, reward, rollout, trainer, _, _, _ in rounds:
        assert breached == "passed"
        assert 0.0 < float(reward) <= 1.0  # sampled completions were scored
        assert abs(float(rollout) - float(trainer)) <= 0.1  # FP8 rollouts serve the trainer's policy


@pytest.mark.engine
def test_demo_learns_and_the_seed_bug_replica_does_not_serve_the_policy(tmp_path, ray_cluster):
    """A short demo: reward rises, refit's rollouts track the trainer, the replica keeping its placeholder KV scales collapses."""
    png = tmp_path / "demo.png"
    # Half the default dataset (32 prompts): the test's three rounds cost half as much and still learn
    # (a run's numbers: docs/performance.md, "The demo").
    out = run_python(["-m", "examples.demo", "--rounds", "3", "--prompts", "32", "--plot", str(png), "--address", ray_cluster.address])
    assert re.search(r"^engines started: up [\d.]+ s after the loop began", out, re.MULTILINE), out
    rounds = ROUND.findall(out)
    assert len(rounds) == 3, out
    for _, version, _, breached, _, rollout, trainer, _, *scales in rounds:
        assert breached == "passed" and abs(float(rollout) - float(trainer)) <= 0.1, out
        assert scales == [f"8 attention default@v1, 8 weight refit@v{version}"] * 2  # KV placeholders reset once, at v1
    seed_bug_scales = re.findall(r"^  seed-bug scales: (.*); probe (passed|BREACHED)", out, re.MULTILINE)
    assert [s for s, _ in seed_bug_scales] == [f"8 attention placeholder, 8 weight refit@v{v}" for v in range(1, 4)], out
    assert all(probe == "BREACHED" for _, probe in seed_bug_scales), out  # refit's probe sees what the seed bug serves
    final = re.search(r"^reward ([\d.]+) -> ([\d.]+); refit rollouts within ([\d.]+) of the trainer; "
                      r"seed-bug replica accuracy ([\d.]+)$", out, re.MULTILINE)
    assert final, out
    first, last, gap, seed_bug = map(float, final.groups())
    assert last >= first + 0.08, out  # the policy learns through the FP8 rollouts; well below a run's gain, as 3 rounds are noisy
    assert gap <= 0.1, out
    # Placeholder KV scales: not the policy refit's rollouts serve. Over the rounds, since one round's greedy accuracy
    # moves with the policy, and may fall while the reward rises (docs/performance.md, "The demo").
    refit_mean = sum(float(r[5]) for r in rounds) / len(rounds)
    seed_bug_mean = sum(float(r[7]) for r in rounds) / len(rounds)
    assert seed_bug == float(rounds[-1][7]) and seed_bug_mean <= refit_mean - 0.1, out
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 10_000
    assert "Traceback" not in out
    noise = [line for line in out.splitlines() if "WARNING" in line and "refit" not in line]
    assert not noise, noise  # refit's own lines, not vLLM's warnings


@pytest.mark.engine
def test_own_engine_a_user_written_actor_with_its_own_llm_serves_the_trainers_weights(ray_cluster):
    """examples/own_engine.py: a `vllm.LLM` the user's actor constructed, made a replica by refit and synced."""
    out = run_python(["examples/own_engine.py"], ray_address=ray_cluster.address)
    expected = expected_continuation([7, 10, 13, 16, 19, 22, 25, 28], NEW_TOKENS)
    assert printed_tokens(out, "trainer:") == [expected]
    assert printed_tokens(out, "my rollout:") == [expected]
    assert "sync v1:" in out, out
    assert re.search(r"model\.layers\.1\.self_attn\.attn +k_scale +default +1 +1$", out, re.MULTILINE), out  # dummy KV scale reset
    assert re.search(r"model\.layers\.1\.mlp\.down_proj +weight_scale +refit +1 ", out, re.MULTILINE), out


LORA_ROUND = re.compile(
    r"^round (\d+): adapter policy v(\d+) synced in \d+ ms, (\d+) KiB per replica, served by policy v(\d+) \(base untouched\)\n"
    r"  mean reward ([\d.]+), greedy accuracy rollout ([\d.]+) trainer ([\d.]+)$", re.MULTILINE)


@pytest.mark.engine
def test_lora_rl_learns_through_adapter_only_syncs_into_fp8_rollouts(ray_cluster):
    """examples/lora_rl.py: each round sends the adapter alone, the rollouts serve it, and the reward rises."""
    out = run_python(["examples/lora_rl.py", "--address", ray_cluster.address, "--rounds", "4", "--prompts", "16"])
    rounds = LORA_ROUND.findall(out)
    assert len(rounds) == 4, out
    for index, (round_, version, kib, served, _, rollout, trainer) in enumerate(rounds):
        assert int(round_) == index and int(version) == int(served) == index + 1, out
        assert int(kib) == 256  # 7 projections x 2 layers, rank 8, fp32: the adapter alone
        assert abs(float(rollout) - float(trainer)) <= 0.1, out  # FP8 base + adapter serves the bf16 policy
    rewards = [float(r[4]) for r in rounds]
    assert rewards[-1] >= rewards[0] + 0.05, out  # it learns; well below a run's gain (docs/lora.md), as 4 rounds are noisy
    assert "Traceback" not in out
