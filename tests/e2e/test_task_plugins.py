"""A user's own task or reward without forking echo2 (``echo2/tasks/plugins.py``, ``echo2/tasks/reward_fn.py``,
``echo2/fleet/extra_packages.py``): the example package in ``tests/plugins/echo2_example_plugin`` is "installed" into
a temporary folder (its source on ``sys.path`` and a ``.dist-info`` with the entry points its pyproject declares,
which is all ``importlib.metadata`` reads), then found by name, its own config validated, a reward function scored
and a forged reward caught by the learner; bad entries, missing packages and credential files stop in one line."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import commit_rollouts, rollout_bytes

from echo2.config import ConfigError, load_config
from echo2.data.rollouts import Rollout, RolloutLimits
from echo2.data.store import open_store
from echo2.errors import Echo2InputError
from echo2.fleet.extra_packages import (
    REQUIREMENTS_FILE,
    ExtraPackageError,
    check_local_actors,
    stage_extra_packages,
)
from echo2.learner.collector import RolloutCollector
from echo2.learner.verify import TaskVerifier
from echo2.tasks import check_task_code, make_task

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "tests" / "plugins" / "echo2_example_plugin"


def install_example_plugin(site: Path) -> Path:
    """What ``pip install`` leaves that echo2 reads: the package importable, its entry points in a dist-info."""
    project = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()) + "\n"
        for group, points in project["entry-points"].items()))
    return site


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    site = install_example_plugin(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(PLUGIN))
    yield site
    for name in [m for m in sys.modules if m.startswith("echo2_example_plugin")]:
        del sys.modules[name]


@pytest.fixture
def dataset(tmp_path) -> Path:
    """Twelve prompts, each answered by a colour, in columns named as a user's file might name them."""
    colours = ["red", "green", "blue", "amber", "violet", "cyan", "pink", "teal", "gold", "grey", "navy", "lime"]
    path = tmp_path / "colours.jsonl"
    path.write_text("".join(json.dumps({"q": f"Name colour number {i}.", "meta": {"gold": c}}) + "\n"
                            for i, c in enumerate(colours)))
    return path


def reward_fn_config(dataset: Path, *extra: str):
    return load_config(None, ["task.name=reward_fn", f"task.dataset={dataset}", "task.columns.prompt=q",
                              "task.columns.answer=meta.gold", "task.eval_size=4", *extra]).task


# -- plugin tasks ------------------------------------------------------------------------------------------------


def test_a_plugin_task_is_found_by_its_entry_point_name_and_gets_its_own_config(plugin):
    task = make_task(load_config(None, ["task.name=plugin", "task.entry=say-word", "task.word=maybe"]).task)
    assert type(task).__name__ == "SayWordTask" and task.name == "say-word" and task.config.word == "maybe"
    problem = task.sample_train(random.Random(0), 1)[0]
    assert "maybe" in problem.messages[0]["content"] and task.problem(problem.id) == problem
    assert task.reward(problem, "maybe " * problem.answer)[0] == 1.0 and task.reward(problem, "maybe")[0] == 0.0
    same = make_task(load_config(None, ["task.name=plugin",
                                        "task.entry=echo2_example_plugin.tasks:SayWordTask"]).task)
    assert type(same).__name__ == "SayWordTask" and same.config.word == "yes"  # module:attribute, defaults
    assert check_task_code(load_config(None, ["task.name=plugin", "task.entry=say-word"]).task) == [
        "echo2_example_plugin.tasks"]  # what the actors must import too


@pytest.mark.parametrize(("sets", "message"), [
    (["task.wrod=maybe"], r"^invalid config task \(plugin echo2_example_plugin.tasks:SayWordTask\): task.wrod: "
                          r"unknown key$"),
    (["task.eval_size=0"], r"task.eval_size: Input should be greater than or equal to 1 \(got 0\)$"),
    (["task.entry=no-such-task"], r"no installed package declares 'no-such-task' in the entry-point group "
                                  r"echo2.tasks \(found: say-word\)"),
    (["task.entry=no_such_pkg.tasks:T"], r"task.entry no_such_pkg.tasks:T: no module named 'no_such_pkg'"),
    (["task.entry=echo2_example_plugin.tasks:Missing"], r"module echo2_example_plugin.tasks has no attribute "
                                                         r"'Missing'"),
    (["task.entry=echo2_example_plugin.rewards:contains_answer"], r"is a function, not a subclass of "
                                                                   r"echo2.tasks.Task"),
    (["task.entry=echo2.tasks.arithmetic:ArithmeticTask", "task.digits=2"], r"task.digits: unknown key \(the "
                                                                            r"plugin declares no Config\)"),
])
def test_a_bad_plugin_is_one_line_naming_what_is_wrong(plugin, sets, message):
    config = load_config(None, ["task.name=plugin", "task.entry=say-word", *sets]).task
    for check in (make_task, check_task_code):
        with pytest.raises(ConfigError, match=message) as caught:
            check(config)
        assert "\n" not in str(caught.value)


def test_a_misspelt_entry_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"task.plugin.entry: .*'my pkg:T' is not module.path:attribute"):
        load_config(None, ["task.name=plugin", "task.entry=my pkg:T"])
    with pytest.raises(ConfigError, match="task.reward_fn.reward_range: .*low < high"):
        load_config(None, ["task.name=reward_fn", "task.dataset=x.jsonl", "task.reward=m:f",
                           "task.reward_range=[1, 0]"])


# -- reward_fn ---------------------------------------------------------------------------------------------------


def test_a_reward_fn_task_scores_replies_with_the_users_function_and_holds_out_a_slice(plugin, dataset):
    task = make_task(reward_fn_config(dataset, "task.reward=contains-answer", "task.instruction=One word.",
                                      "task.system=Be brief."))
    assert task.reward_range == (0.0, 1.0) and len(task.eval_set()) == 4
    held = {p.meta["prompt"] for p in task.eval_set()}
    drawn = task.sample_train(random.Random(1), 50)
    assert len({p.id for p in drawn}) == 8 and not held & {p.meta["prompt"] for p in drawn}  # never trained on
    problem = drawn[0]
    assert problem.messages[0] == {"role": "system", "content": "Be brief."}
    assert problem.messages[1]["content"].endswith("\nOne word.") and task.problem(problem.id) == problem
    assert task.reward(problem, f"It is {problem.answer.upper()}.") == (1.0, {"correct": True})
    assert task.reward(problem, "no idea")[0] == 0.0
    with pytest.raises(Exception, match="held-out"):
        task.problem(f"r{[i for i in range(12) if f'r{i}' not in {p.id for p in drawn}][0]}")
    eval_file = dataset.parent / "eval.jsonl"
    eval_file.write_text(json.dumps({"q": "Name the sky.", "meta": {"gold": "blue"}}) + "\n")
    split = make_task(reward_fn_config(dataset, "task.reward=echo2_example_plugin.rewards:contains_answer",
                                       f"task.eval_dataset={eval_file}"))
    assert [p.meta["prompt"] for p in split.eval_set()] == ["Name the sky."] and len(split._train_rows) == 12


def test_a_reward_function_that_fails_scores_the_low_end_on_every_machine(plugin, dataset, tmp_path, monkeypatch):
    (tmp_path / "flaky_rewards.py").write_text(
        "def score(prompt, completion, answer):\n"
        "    if 'boom' in completion:\n        raise KeyError(completion)\n"
        "    return 5.0 if 'big' in completion else 'yes' if 'text' in completion else -1.0\n"
        "def two(prompt, completion):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = make_task(reward_fn_config(dataset, "task.reward=flaky_rewards:score", "task.reward_range=[-1, 2]"))
    problem = task.eval_set()[0]
    assert task.reward(problem, "fine") == (-1.0, {"correct": False})
    for reply, why in (("boom", "raised KeyError"), ("big", "outside task.reward_range [-1, 2]"),
                       ("text", "not a finite number")):
        reward, detail = task.reward(problem, reply)
        assert reward == -1.0 and why in detail["error"], detail
    with pytest.raises(ConfigError, match=r"task.reward flaky_rewards:two cannot be called as score\(prompt, "
                                          r"completion, answer\)"):
        make_task(reward_fn_config(dataset, "task.reward=flaky_rewards:two"))


@pytest.mark.e2e  # a tiny model, or a process of its own: over a second
def test_a_forged_reward_of_a_reward_fn_task_is_caught_by_the_learner_and_bans_the_actor(plugin, dataset,
                                                                                         tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    task = make_task(reward_fn_config(dataset, "task.reward=contains-answer"))
    store = open_store(str(tmp_path / "store"))
    limits = RolloutLimits(vocab_size=len(tok), group_size=2, max_completion_tokens=64, max_prompt_tokens=4096,
                           reward_range=task.reward_range)
    collector = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=2, limits=limits,
                                 verifier=TaskVerifier(task, tok, max_new_tokens=64))

    def rollout_file(actor, seed, claim):
        rows = []
        for g, problem in enumerate(task.sample_train(random.Random(seed), 2)):
            for s, reply in enumerate((problem.answer, "no idea")):
                completion = tok(reply, add_special_tokens=False)["input_ids"]
                rows.append(Rollout(prompt_id=problem.id, group_id=f"g{g}", sample_index=s,
                                    prompt_token_ids=task.prompt_tokens(tok, problem),
                                    completion_token_ids=completion, behavior_logprobs=[-0.5] * len(completion),
                                    reward=claim(task.reward(problem, reply)[0]), finish_reason="stop"))
        return rollout_bytes(1, rollouts=rows, actor=actor)

    forged = commit_rollouts(store, 1, 0, actor="a1-forges", data=rollout_file("a1-forges", 0, lambda r: 1.0))
    honest = commit_rollouts(store, 1, 0, actor="a2-honest", data=rollout_file("a2-honest", 1, lambda r: r))
    selection = collector.collect(step=2, learner_version=1, timeout_s=60)
    assert [u["key"] for u in selection.used] == [honest]
    reason = {q["key"]: q["reason"] for q in selection.quarantined}[forged]
    assert "reward 1 but the task scores the completion 0" in reason, reason
    assert set(collector.banned) == {"a1-forges"}


# -- launch checks and fleet.extra_packages ----------------------------------------------------------------------


@pytest.mark.e2e  # a tiny model, or a process of its own: over a second
def test_a_bad_entry_stops_the_launch_in_one_line_before_anything_starts(plugin, tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text(f"store:\n  url: {tmp_path}\ntask:\n  name: plugin\n  entry: say-wrod\n")
    code = ("from echo2.cli import main; import sys\n"
            f"sys.argv = ['echo2', 'run', {str(config)!r}, '--dry-run']\nmain()\n")
    env = {**os.environ, "PYTHONPATH": str(plugin)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "'say-wrod'" in lines[0] and "found: say-word" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_local_actors_share_the_learners_interpreter_so_extra_packages_must_be_installed_there(plugin):
    check_local_actors(["echo2-example-plugin", "pydantic>=2", str(PLUGIN)], ["echo2_example_plugin.rewards"])
    with pytest.raises(ExtraPackageError, match=r"no-such-dist is not installed in the learner's interpreter .*"
                                                r"which local actors run .*pip install 'no-such-dist'"):
        check_local_actors(["no-such-dist"], [])
    with pytest.raises(ExtraPackageError, match=r"has pydantic 2\.\S+: pip install 'pydantic<1'"):
        check_local_actors(["pydantic<1"], [])
    with pytest.raises(ExtraPackageError, match="the task's module not_there does not import"):
        check_local_actors([], ["not_there"])
    # another interpreter for the actors (fleet.actor_python) is asked in a process of its own
    with pytest.raises(ExtraPackageError, match=r"echo2-example-plugin is not installed in fleet.actor_python"):
        check_local_actors(["./tests/plugins/echo2_example_plugin"], [], actor_python="/usr/bin/python3")


def test_extra_packages_are_local_paths_or_pip_requirements():
    fleet = load_config(None, ["fleet.extra_packages=[./pkg, my-rewards==1.2, ~/w.whl]"]).fleet
    assert fleet.extra_packages == ["./pkg", "my-rewards==1.2", "~/w.whl"]
    with pytest.raises(ConfigError, match=r"'--index-url http://x' is neither a local path \(./my_pkg\) nor a pip "
                                          r"requirement"):
        load_config(None, ["fleet.extra_packages=['--index-url http://x']"])


def test_local_packages_are_staged_for_skypilot_actors_without_credential_files(tmp_path, monkeypatch):
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    lines = stage_extra_packages([str(PLUGIN), "my-rewards==1.2"], workdir)
    assert lines == ["./extra-packages/0-echo2_example_plugin", "my-rewards==1.2"]
    assert (workdir / REQUIREMENTS_FILE).read_text() == "".join(f"{line}\n" for line in lines)
    staged = workdir / "extra-packages" / "0-echo2_example_plugin"
    assert (staged / "pyproject.toml").is_file() and (staged / "echo2_example_plugin" / "tasks.py").is_file()
    assert not list(staged.rglob("__pycache__"))

    for secret in (".env", "deploy.pem", ".aws/credentials", "id_ed25519"):
        project = tmp_path / f"pkg-{secret.replace('/', '-')}"
        (project / "mine").mkdir(parents=True)
        (project / "pyproject.toml").write_text("[project]\nname = 'mine'\nversion = '1'\n")
        (project / secret).parent.mkdir(parents=True, exist_ok=True)
        (project / secret).write_text("SECRET")
        with pytest.raises(ExtraPackageError, match=f"{secret} looks like a credential"):
            stage_extra_packages([str(project)], tmp_path / "other")
    home = tmp_path / "home"  # a project folder that is the home folder itself, with ~/.config/echo2/keys in it
    (home / ".config" / "echo2" / "keys").mkdir(parents=True)
    (home / "pyproject.toml").write_text("[project]\nname = 'home'\nversion = '1'\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("ECHO2_SECRETS")
    with pytest.raises(Echo2InputError, match="a home folder or echo2's key folder never travels"):
        stage_extra_packages(["~"], tmp_path / "other")


def test_skypilot_actors_install_extra_packages_from_their_staged_workdir(tmp_path, monkeypatch):
    """SkyPilot's real Task from the shipped task file and its optimizer, with the test double of
    tests/e2e/test_skypilot.py where a cloud would be asked: the workdir the launch uploads holds the local package
    beside echo2's source and the requirements file the task's setup installs."""
    from test_skypilot import FakeLaunchApi, backend_with, cluster_name, described, spec, wait_for  # skips without

    api = FakeLaunchApi()
    backend = backend_with(api, extra_packages=[str(PLUGIN), "my-rewards==1.2"])
    launch = spec()
    backend.launch(launch)
    task = described(wait_for(lambda: api.tasks.get(cluster_name("run-20261201-191000-ab12", launch.actor_id)),
                              "the launch"))
    root = Path(task["workdir"])
    assert (root / REQUIREMENTS_FILE).read_text() == "./extra-packages/0-echo2_example_plugin\nmy-rewards==1.2\n"
    assert (root / "extra-packages" / "0-echo2_example_plugin" / "echo2_example_plugin" / "rewards.py").is_file()
    assert (root / "echo2" / "rollout" / "actor.py").is_file()  # echo2's own source beside it
    assert f"pip\" install --quiet -r {REQUIREMENTS_FILE}" in task["yaml"]["setup"]
    assert not task["file_mounts"] and not task["storage_mounts"]
    backend.terminate(launch.actor_id)
    backend.close()
    assert not root.exists()

    with pytest.raises(ValueError, match="setup never installs extra-requirements.txt"):
        backend_with(api, extra_packages=["my-rewards"]).__class__(
            backend.config, run_id="r", api=api, task_config={"setup": "true", "run": "true"})
    secret_project = tmp_path / "leaky"
    (secret_project / ".ssh").mkdir(parents=True)
    (secret_project / "pyproject.toml").write_text("[project]\nname = 'leaky'\nversion = '1'\n")
    (secret_project / ".ssh" / "config").write_text("Host *")
    leaky = backend_with(api, extra_packages=[str(secret_project)])
    with pytest.raises(ExtraPackageError, match=r".ssh/config looks like a credential"):
        leaky.start()
    assert leaky.workdir is None


@pytest.mark.e2e
def test_echo2_run_trains_on_a_reward_fn_task_of_an_installed_package(tiny_model, dataset, tmp_path):
    """The whole path: `echo2 run` checks the entry, the local actor imports the reward function from the package
    (found by its entry-point name), and the learner re-scores every reply with it."""
    site = install_example_plugin(tmp_path / "site")
    config = tmp_path / "mine.yaml"
    config.write_text(f"model:\n  name: {tiny_model}\nstore:\n  url: {tmp_path}\nrun:\n  id: mine\n"
                      f"task:\n  name: reward_fn\n  reward: contains-answer\n  dataset: {dataset}\n"
                      f"  columns: {{prompt: q, answer: meta.gold}}\n  eval_size: 4\n"
                      f"rollout: {{group_size: 2, groups_per_batch: 2, max_new_tokens: 4}}\n"
                      f"train: {{max_steps: 2, groups_per_step: 2, checkpoint_every: 2}}\n"
                      f"eval: {{max_new_tokens: 4, before: false}}\nfleet: {{backend: local, actors: 1}}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PLUGIN), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "run", str(config)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "mine" / "reports" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["rollouts_quarantined"] == 0, summary
    assert "eval_after" in summary
