"""The ``hostile-store`` scenario's resume leg: junk that costs the learner per file, met by a resumed learner.

On a local store (``fleet.backend: local``), as holders of actors' credentials could write on any store:

1. the learner runs the math task on the tiny model and dies (a failpoint's SIGKILL) after it published v5 past
   its checkpoint 4: v5 is the lost timeline's;
2. before the resume, a flood of empty files in folders far in the future (``FLOODER``: ten thousand at full
   size), which must not stall the resume or its first collection (``FIRST_COLLECTION_S``);
3. while the resumed learner trains: ``PADDER`` commits one real batch and three byte-for-byte copies of it, and
   files of the lost timeline that do not even decode in the name of an actor the dead learner launched (what
   an adopted actor could write to have them dropped uncounted as "lost timeline").

Each kind is detected only by its own evidence: the copies dropped as byte copies (or the padder's ban naming
them), the flooder's ban, the lost-timeline files quarantined as malformed (not dropped as lost timeline); the
first collection after the resume is timed from the resume's ledger event (written before anything moves) to
that step's ledger entry.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos.rows import audit_row
from echo2.data import layout

KINDS = ("duplicate-padding", "future-flood", "lost-timeline-malformed")
PADDER = "a1-padder"
FLOODER = "a2-flood"
FIRST_COLLECTION_S = 60.0
"""The first collection after the resume must return within this, flood or not."""
CHECKPOINT_EVERY = 4
KILL_AT = "step:11"
"""``failpoint("step")`` passes twice a step (its files chosen, then trained): the 11th is step 6's choice, after
v5 was published and checkpoint 4 written."""
_COPY = re.compile(r"byte-for-byte", re.I)
_FLOOD = re.compile(r"wait in the store|future|invalid", re.I)


def pickle_payload(command: str) -> bytes:
    """A pickle that runs ``command`` when loaded, naming ``os.system`` through a module a checkpoint's metadata may
    name (``torch.distributed.checkpoint.filesystem``), as protocol 4 resolves dotted names."""
    def text(s: str) -> bytes:
        b = s.encode()
        return b"X" + len(b).to_bytes(4, "little") + b  # BINUNICODE

    return (b"\x80\x04" + text("torch.distributed.checkpoint.filesystem") + text("os.system") + b"\x93"
            + text(command) + b"\x85R.")


class ResumeAttacker:
    """Writes, while the resumed learner runs (``run_cli``'s ``while_running``), once the new timeline has published
    the lost timeline's first number again: the padding and the malformed lost-timeline files."""

    def __init__(self, run_dir: Path, *, run_id: str, tokenizer, task, checkpoint: int, victim: str):
        self.run_dir, self.run_id, self.tok, self.task = run_dir, run_id, tokenizer, task
        self.checkpoint, self.victim = checkpoint, victim
        self.keys: dict[str, list[str]] = {kind: [] for kind in KINDS}
        self.done = False

    def _put(self, kind: str, key: str, data: bytes) -> None:
        path = self.run_dir / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.keys[kind].append(key)

    def step(self, proc) -> None:
        if self.done or not self._resumed_and_stepped():
            return
        try:
            latest = json.loads((self.run_dir / layout.LATEST).read_text())["version"]
        except (OSError, ValueError, KeyError):
            return
        real = self._rows(latest)
        self._put("duplicate-padding", layout.rollout_key(latest, PADDER, 1), real)
        for seq in (2, 3, 4):
            self._put("duplicate-padding", layout.rollout_key(latest, PADDER, seq), real)
        lost = self.checkpoint + 1  # a version of the lost timeline
        for seq, data in enumerate((b"ARROW1", b"not an arrow file", real[: len(real) // 2]), start=900_001):
            self._put("lost-timeline-malformed", layout.rollout_key(lost, self.victim, seq), data)
        self.done = True

    def _resumed_and_stepped(self) -> bool:
        """Whether the resumed learner has written the entry of its first step (the dead one's was moved aside)."""
        resumed = [e.get("ts", 0) for e in _events(self.run_dir) if e.get("kind") == "resume"]
        entry = self.run_dir / layout.consumed_key(self.checkpoint + 1)
        try:
            return bool(resumed) and json.loads(entry.read_text())["written_at"] > min(resumed)
        except (OSError, ValueError, KeyError):
            return False

    def _rows(self, version: int) -> bytes:
        """One batch the learner can use: the task's prompts, a reply no grader finds right (reward 0)."""
        from echo2.data.rollouts import Rollout, encode_rollouts
        from echo2.tasks import prompt_token_ids

        ids = self.tok("no answer<|im_end|>", add_special_tokens=False)["input_ids"]
        problems = self.task.sample_train(random.Random(version), 2)
        rows = [Rollout(prompt_id=p.id, group_id=f"g{g}", sample_index=s,
                        prompt_token_ids=prompt_token_ids(self.tok, p), completion_token_ids=ids,
                        behavior_logprobs=[-1.0] * len(ids), reward=0.0, finish_reason="stop")
                for g, p in enumerate(problems) for s in range(4)]
        return encode_rollouts(rows, run_id=self.run_id, actor_id=PADDER, policy_version=version, task="math")


def flood(run_dir: Path, files: int, folders: int = 100) -> list[str]:
    """``files`` empty files of ``FLOODER`` in ``folders`` folders far beyond anything published."""
    keys = []
    per = -(-files // folders)
    for n in range(files):
        key = layout.rollout_key(500_000 + n // per, FLOODER, n)
        path = run_dir / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        keys.append(key)
    return keys


def ledger_outcomes(run_dir: Path) -> dict[str, tuple[str, str]]:
    """key -> (used | dropped | quarantined, reason) from every ledger entry of a run folder."""
    out: dict[str, tuple[str, str]] = {}
    for path in sorted((run_dir / "ledger" / "consumed").glob("*.json")):
        record = json.loads(path.read_text() or "{}")
        for status in ("used", "dropped", "quarantined"):
            for item in record.get(status, []):
                out[item["key"]] = (status, item.get("reason", ""))
    return out


def _bans(run_dir: Path) -> dict[str, str]:
    return {p.stem: json.loads(p.read_text()).get("reason", "") for p in (run_dir / "ledger" / "bans").glob("*.json")}


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text() or "{}") for p in (run_dir / "ledger" / "events").glob("*.json")]


def first_collection_s(run_dir: Path) -> tuple[float | None, int | None]:
    """Seconds from the (first) resume's ledger event to the entry of the step after it, and that checkpoint step."""
    resumes = sorted((e for e in _events(run_dir) if e.get("kind") == "resume"), key=lambda e: e.get("ts", 0))
    if not resumes:
        return None, None
    step = resumes[0].get("step")
    entry = run_dir / layout.consumed_key(step + 1)
    if not entry.exists():
        return None, step
    return json.loads(entry.read_text())["written_at"] - resumes[0]["ts"], step


def judge(attacker: ResumeAttacker, flooded: list[str], run_dir: Path) -> dict[str, tuple[bool, str]]:
    """Per kind: (detected by its own evidence, the evidence)."""
    ledger, bans = ledger_outcomes(run_dir), _bans(run_dir)
    copies = attacker.keys["duplicate-padding"][1:]
    seen = [ledger.get(k, ("not judged", "")) for k in copies]
    padded = bool(copies) and (all(s == "dropped" and _COPY.search(r) for s, r in seen)
                               or bool(_COPY.search(bans.get(PADDER, ""))))
    out = {"duplicate-padding": (padded, f"ban: {bans.get(PADDER, 'none')[:120]}; "
                                         + "; ".join(f"{s}: {r[:70]}" for s, r in seen[:2]))}
    gone = sum(not (run_dir / k).exists() for k in flooded)
    out["future-flood"] = (bool(flooded) and bool(_FLOOD.search(bans.get(FLOODER, ""))),
                           f"ban: {bans.get(FLOODER, 'none')[:120]}; {gone}/{len(flooded)} deleted by the janitor, "
                           f"{sum(k in ledger for k in flooded)} in the final entry")
    malformed = [ledger.get(k, ("not judged", "")) for k in attacker.keys["lost-timeline-malformed"]]
    out["lost-timeline-malformed"] = (
        bool(malformed) and all(s == "quarantined" and not r.startswith("lost timeline") for s, r in malformed),
        "; ".join(f"{s}: {r[:80]}" for s, r in malformed[:2]) + f"; ban of {attacker.victim}: "
        + bans.get(attacker.victim, "none")[:80])
    return out


def resume_leg(workdir: Path, model: Path, tokenizer, task, *, math_config: str, sets: list[str],
               quick: bool) -> dict:
    """Run the leg (see the module docstring); returns its kinds, whether its runs finished, the audit's lost
    files, what did not hold (``broken``) and a detail line."""
    run_id = f"hostile-local-{secrets.token_hex(3)}"
    store = workdir / "local-store"
    run_dir = store / layout.RUNS / run_id
    args = ["run", math_config, *h.sets(f"model.name={model}", f"store.url={store}", f"run.id={run_id}", *sets,
                                        "fleet.actors=1", "trust.spot_check_fraction=0", "publish.every=1",
                                        f"train.checkpoint_every={CHECKPOINT_EVERY}")]
    env = h.environment(workdir)
    killed = h.run_cli(args + h.sets("train.max_steps=40"), workdir, workdir / "local.log",
                       env={**env, "ECHO2_FAILPOINTS": KILL_AT}, timeout=600)
    launched = [e["actor_id"] for e in sorted(_events(run_dir), key=lambda e: e.get("ts", 0))
                if e.get("kind") == "launch"]
    checkpoint = max([layout.parse_step_dir(p.name) or 0 for p in (run_dir / "checkpoints").glob("step-*")
                      if (p / layout.MANIFEST).exists()], default=0)
    broken = []
    if killed != -9 or not launched or checkpoint != CHECKPOINT_EVERY:
        broken.append(f"the first run was to die after v{CHECKPOINT_EVERY + 1} past checkpoint {CHECKPOINT_EVERY}: "
                      f"exit {killed}, checkpoint {checkpoint}, actors {launched}")
    flooded = flood(run_dir, 1_000 if quick else 10_000, folders=20 if quick else 100)
    attacker = ResumeAttacker(run_dir, run_id=run_id, tokenizer=tokenizer, task=task, checkpoint=checkpoint,
                              victim=launched[0] if launched else "actor0-000000")
    started = time.time()
    code = h.run_cli(args + h.sets(f"train.max_steps={checkpoint + 6}") + ["--resume"], workdir,
                     workdir / "local-resume.log", env=env, timeout=600, while_running=attacker.step)
    row = audit_row("hostile-store-resume", run_dir, code)
    first_s, resumed_from = first_collection_s(run_dir)
    if first_s is None or first_s > FIRST_COLLECTION_S:
        broken.append(f"the first collection after the resume took {first_s} s (at most {FIRST_COLLECTION_S:.0f})")
    if not attacker.done:
        broken.append("the resumed run ended before the attacker wrote")
    kinds = judge(attacker, flooded, run_dir)
    detail = (f"resume leg: first run exit {killed} (SIGKILLed after v{checkpoint + 1}), {len(flooded)} empty future "
              f"files, resume from step {resumed_from} exit {code} in {time.time() - started:.0f} s, first collection "
              f"{first_s if first_s is None else round(first_s, 1)} s")
    return {"kinds": kinds, "finished": row["finished"], "lost": row["lost"], "broken": broken, "detail": detail,
            "first_collection_s": first_s}
