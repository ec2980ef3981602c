"""The ``hostile-store`` chaos scenario: one actor with its own scoped store credentials attacks a live run
through the store, with every kind of object the store lets it write.

Played by the harness (``HostileActor``), on moto's S3 with IAM enforced (``moto_iam.py``): an STS session
whose policy is the real actor policy (``fleet/credentials.py``). It writes, in three waves while the real
learner trains the math task with two honest actors:

1. a rollout file and its relay peer record stored as GLACIER (HEAD works, GET is 403);
2. an object far over ``trust.max_rollout_file_mb``, and a peer record of megabytes;
3. a file whose replies hang the math grader (claiming the reward a timeout scores), files for versions far
   beyond LATEST+1, a flood of junk files, and a planted checkpoint (its credentials must not allow it).

Then, as anyone with wider write access could (a leaked operator key, a store without per-actor scoping), a
checkpoint ``step-999999`` with a forged manifest is planted, and ``step-999998`` whose DCP metadata
(``dcp-metadata``) is a pickle that would create a marker file if anything loaded it (``store_junk.pickle_payload``,
naming ``os.system`` through a module the metadata may name); then the run is resumed.

A second leg on a local store (``store_junk.py``) kills a learner past its checkpoint, floods future folders with
empty files (ten thousand; a thousand in ``quick``) before the resume, and while the resumed learner trains pads a
real batch with byte-for-byte copies and writes malformed files of the lost timeline in a launched actor's name;
the first collection after that resume must return within a minute.

The row: ``injected`` counts the kinds; a kind is ``detected`` only on evidence that the system caught it:
a quarantine reason in the ledger that names it, the actor's ban, or a log line naming the object. The runs
must finish (and their resumes), each honest actor must have files used after the first hostile upload, the
hostile actor must be banned and revoked, nothing planted may be loaded or run (the marker never appears), and
the first collection after the local resume must return in time (``broken`` lists what did not hold). Files of a
banned actor are no longer judged one by one: its ban record stands for them and the learner's janitor deletes
them, so such a file counts as caught when it is quarantined, dropped by the ban, or deleted while its actor is
banned. ``quick``: the size ``tests/e2e/test_chaos.py`` runs.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import shutil
import signal
import time
from pathlib import Path

from echo2.chaos import harness as h
from echo2.chaos import store_junk
from echo2.chaos.rows import audit_row, bad_loads, result_row
from echo2.data import layout

MATH = str(h.REPO / "configs" / "math-smollm2.yaml")
MATH_TINY = ["rollout.max_new_tokens=32", "eval.max_new_tokens=8", "task.grade_timeout_s=1",
             "trust.max_rollout_file_mb=1", "fleet.actors=2"]
"""The math task on the tiny model: replies long enough for a hanging one, a short grading limit."""
HOSTILE = "a0-hostile"
"""Sorts before the honest actors' ids: the collector meets its files first in a folder."""
HANG = r"\boxed{9^{9^{9^{9^{9}}}}}"
"""A reply sympy works on for as long as it is let (``tasks/math_grader.py``)."""
PLANTED_STEP = 999_999
PICKLE_STEP = 999_998
"""A planted checkpoint whose DCP metadata is a pickle that runs a command."""
KINDS = ("glacier-rollout", "glacier-peer", "huge-object", "huge-peer", "hanging-math", "future-versions",
         "junk-flood", "planted-checkpoint", "pickle-payload", *store_junk.KINDS)
ROLLOUT_KINDS = ("glacier-rollout", "huge-object", "hanging-math", "future-versions", "junk-flood")
"""The kinds written as rollout files (the collector judges each)."""

_UNREADABLE = re.compile(r"storage class|glacier|unreadable|not readable|cannot be read|could not be read|"
                         r"permission|access denied|invalidobjectstate|403", re.I)
_OVERSIZE = re.compile(r"over the limit|too large|too big|bytes", re.I)
_GRADING = re.compile(r"grad|budget|timed? ?out", re.I)
_FUTURE = re.compile(r"future|ahead|beyond", re.I)


class HostileActor:
    """The attacker, called every half second by ``run_cli`` while the learner runs (``step``)."""

    def __init__(self, s3, admin, bucket: str, root: str, *, run_id: str, tokenizer, task, quick: bool):
        self.s3, self.admin, self.bucket, self.root = s3, admin, bucket, root
        self.run_id, self.tok, self.task = run_id, tokenizer, task
        self.junk, self.future = (40, 2) if quick else (300, 8)
        self.huge_bytes = (16 if quick else 128) * 2**20
        self.steps_after = (4, 30) if quick else (16, 40)
        """Steps trained after the last wave before the run is interrupted (Ctrl-C) for the planted checkpoint:
        at least the first, and until every planted file is judged (the far future waits for the collector's
        periodic full sweep) or the second."""
        self.keys: dict[str, list[str]] = {kind: [] for kind in KINDS}
        """What it wrote, by kind (keys in the run)."""
        self.wave, self.seq = 0, 0
        self.latest_at_wave, self.waited_from = 0, 0.0  # when the last wave went out
        self.first_upload_step: int | None = None  # the ledger's last step when the first wave went out
        self.first_wave3_step = 0
        self.interrupted_at: int | None = None
        self.checkpoint_refused = ""  # what the store answered its own credentials' checkpoint
        self.store_refused: list[str] = []  # kinds whose GLACIER put its own credentials were refused
        self._next_look = 0.0

    # -- the store as each side sees it --------------------------------------------------------
    def _latest(self) -> int | None:
        try:
            body = self.admin.get_object(Bucket=self.bucket, Key=self.root + layout.LATEST)["Body"].read()
            return int(json.loads(body)["version"])
        except self.admin.exceptions.NoSuchKey:
            return None

    def _consumed_steps(self) -> int:
        found = self.admin.list_objects_v2(Bucket=self.bucket, Prefix=self.root + layout.LEDGER_CONSUMED)
        return max([layout.step_of_consumed_key(o["Key"][len(self.root):]) or 0 for o in found.get("Contents", [])],
                   default=0)

    def _keys(self, prefix: str) -> set[str]:
        pages = self.admin.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.root + prefix)
        return {o["Key"][len(self.root):] for page in pages for o in page.get("Contents", [])}

    def _judged(self, keys: list[str]) -> bool:
        """Whether the learner has set every one of ``keys`` aside: moved out of rollouts/, or its quarantine
        reason written (an object the store cannot copy is quarantined where it lies)."""
        pending, reasons = self._keys(layout.ROLLOUTS), self._keys(layout.QUARANTINE)
        return all(k not in pending or layout.quarantine_reason_key(k) in reasons for k in keys)

    def _all_judged(self) -> bool:
        return self._judged([k for kind, keys in self.keys.items() for k in keys if kind in ROLLOUT_KINDS])

    def _put(self, kind: str, key: str, body: bytes, **extra) -> None:
        """With its own credentials. A store that refuses a GLACIER put (the actor policy's condition, where
        it is enforced) gets it with wider ones: what a store without that condition lets through."""
        from botocore.exceptions import ClientError

        try:
            self.s3.put_object(Bucket=self.bucket, Key=self.root + key, Body=body, **extra)
        except ClientError as exc:
            if "StorageClass" not in extra or exc.response["Error"]["Code"] != "AccessDenied":
                raise
            self.store_refused.append(kind)
            self.admin.put_object(Bucket=self.bucket, Key=self.root + key, Body=body, **extra)
        self.keys[kind].append(key)

    def _rollout_key(self, version: int) -> str:
        self.seq += 1
        return layout.rollout_key(version, HOSTILE, self.seq)

    # -- what it writes --------------------------------------------------------------------------
    def _rows(self, version: int, reply: str, reward: float, groups: int = 2) -> bytes:
        from echo2.data.rollouts import Rollout, encode_rollouts
        from echo2.tasks import prompt_token_ids

        ids = self.tok(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows = [Rollout(prompt_id=p.id, group_id=f"g{g}", sample_index=s,
                        prompt_token_ids=prompt_token_ids(self.tok, p), completion_token_ids=ids,
                        behavior_logprobs=[-1.0] * len(ids), reward=reward, finish_reason="stop")
                for g, p in enumerate(self.task.sample_train(random.Random(self.seq), groups)) for s in range(4)]
        return encode_rollouts(rows, run_id=self.run_id, actor_id=HOSTILE, policy_version=version, task="math")

    def _peer_record(self, pad: int = 0) -> bytes:
        record = {"id": HOSTILE, "url": "http://127.0.0.1:9", "version": None, "heartbeat": time.time() + 3600}
        if pad:
            record["pad"] = "x" * pad
        return json.dumps(record).encode()

    def step(self, proc) -> None:
        latest = self._latest()
        if latest is None or self.interrupted_at is not None:
            return
        if self.wave == 3:  # done: once the run has trained on, Ctrl-C (it checkpoints; resumed below)
            trained = self._consumed_steps() - self.first_wave3_step
            least, most = self.steps_after
            done = trained >= most
            if not done and trained >= least and time.time() > self._next_look:  # a full listing: every 2 s
                self._next_look = time.time() + 2.0
                done = self._all_judged()
            if done:
                self.interrupted_at = self._consumed_steps()
                proc.send_signal(signal.SIGINT)
            return
        if self.wave == 0:
            if self._consumed_steps() < 1:
                return
            self.first_upload_step = self._consumed_steps()
            self._put("glacier-peer", layout.peer_key(HOSTILE), self._peer_record(), StorageClass="GLACIER")
            self._put("glacier-rollout", self._rollout_key(latest), self._rows(latest, "7", 0.0),
                      StorageClass="GLACIER")
        elif self.wave == 1:
            if not self._ready(latest, self.keys["glacier-rollout"]):
                return
            self._put("huge-peer", layout.peer_key(HOSTILE), self._peer_record(pad=8 * 2**20))
            self._put("huge-object", self._rollout_key(latest), bytes(self.huge_bytes))
        else:
            if not self._ready(latest, self.keys["huge-object"]):
                return
            # the hanging file first: the collector meets it before the junk in the same folder
            self._put("hanging-math", self._rollout_key(latest),
                      self._rows(latest, HANG, self.task.config.format_reward))
            for i in range(self.future):
                ahead = min(latest + 500 * (i + 1), 999_999) if i < self.future - 1 else 999_999
                self._put("future-versions", self._rollout_key(ahead), self._rows(ahead, "7", 0.0))
            rng = random.Random(7)
            for _ in range(self.junk):
                self._put("junk-flood", self._rollout_key(latest), rng.randbytes(rng.randrange(16, 2048)))
            self.checkpoint_refused = self._plant_checkpoint_with_own_credentials()
            self.first_wave3_step = self._consumed_steps()
        self.wave += 1
        self.latest_at_wave, self.waited_from = latest, time.time()

    def _ready(self, latest: int, keys: list[str], wait_s: float = 30.0) -> bool:
        """The previous wave's file was judged (or ``wait_s`` passed) and two versions were published since
        (each publish reads the peer records)."""
        judged = self._judged(keys) or time.time() - self.waited_from > wait_s
        return judged and latest >= self.latest_at_wave + 2

    def _plant_checkpoint_with_own_credentials(self) -> str:
        from botocore.exceptions import ClientError

        key = self.root + layout.manifest_key(layout.checkpoint_dir(PLANTED_STEP))
        try:
            self.s3.put_object(Bucket=self.bucket, Key=key, Body=b"{}")
        except ClientError as exc:
            return exc.response["Error"]["Code"]
        return "allowed"


def plant_checkpoint(admin, bucket: str, root: str) -> str:
    """As anyone with write access to the whole run could: the newest checkpoint's files copied to
    ``checkpoints/step-999999/``, its manifest moved to that step and signed by the attacker's key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from echo2.data.manifest import SIGNATURE, sign

    found = admin.list_objects_v2(Bucket=bucket, Prefix=root + layout.CHECKPOINTS).get("Contents", [])
    steps = sorted({o["Key"][len(root):].split("/")[1] for o in found})
    if not steps:
        return "no checkpoint to copy"
    source, target = f"{layout.CHECKPOINTS}{steps[-1]}/", layout.checkpoint_dir(PLANTED_STEP) + "/"
    for obj in found:
        name = obj["Key"][len(root + source):]
        if obj["Key"].startswith(root + source) and name != layout.MANIFEST:
            admin.copy_object(Bucket=bucket, Key=root + target + name, CopySource={"Bucket": bucket, "Key": obj["Key"]})
    genuine = json.loads(admin.get_object(Bucket=bucket, Key=root + source + layout.MANIFEST)["Body"].read())
    body = {k: v for k, v in genuine.items() if k != SIGNATURE}
    for holder in (body, body.get("meta") or {}):
        if "step" in holder:
            holder["step"] = PLANTED_STEP
    admin.put_object(Bucket=bucket, Key=root + target + layout.MANIFEST,
                     Body=json.dumps(sign(body, Ed25519PrivateKey.generate())).encode())
    return f"copied from {steps[-1]}"


def plant_pickle(admin, bucket: str, root: str, command: str) -> str:
    """``checkpoints/step-999998/``: the newest checkpoint's files with ``dcp-metadata`` replaced by a pickle that runs
    ``command`` when loaded, its manifest naming that file's hash, signed by the attacker's key."""
    import hashlib

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from echo2.data.manifest import SIGNATURE, sign
    from echo2.learner.checkpoint_files import METADATA, store_name

    payload = store_junk.pickle_payload(command)
    steps = [step for step in _checkpoint_steps(admin, bucket, root) if step < PICKLE_STEP]  # the run's own
    if not steps:
        return "no checkpoint to copy"
    source, target = layout.checkpoint_dir(steps[-1]) + "/", layout.checkpoint_dir(PICKLE_STEP) + "/"
    for obj in admin.list_objects_v2(Bucket=bucket, Prefix=root + source).get("Contents", []):
        name = obj["Key"][len(root + source):]
        if name not in (layout.MANIFEST, store_name(METADATA)):
            admin.copy_object(Bucket=bucket, Key=root + target + name, CopySource={"Bucket": bucket, "Key": obj["Key"]})
    admin.put_object(Bucket=bucket, Key=root + target + store_name(METADATA), Body=payload)
    genuine = json.loads(admin.get_object(Bucket=bucket, Key=root + source + layout.MANIFEST)["Body"].read())
    body = {k: v for k, v in genuine.items() if k != SIGNATURE}
    body["step"] = PICKLE_STEP
    for entry in body.get("files", []):
        if entry.get("name") == store_name(METADATA):
            entry.update(size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    admin.put_object(Bucket=bucket, Key=root + target + layout.MANIFEST,
                     Body=json.dumps(sign(body, Ed25519PrivateKey.generate())).encode())
    return f"copied from step {steps[-1]}, {store_name(METADATA)} a {len(payload)}-byte pickle"


def mirror(admin, bucket: str, prefix: str, into: Path) -> None:
    """The bucket as local files, for the ledger audit and the judging: an object that cannot be read
    (GLACIER) or is huge becomes an empty file of the same name (the audit reads names and the ledger)."""
    from botocore.exceptions import ClientError

    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            target = into / obj["Key"]
            target.parent.mkdir(parents=True, exist_ok=True)
            if obj.get("StorageClass", "STANDARD") != "STANDARD" or obj["Size"] > 16 * 2**20:
                target.write_bytes(b"")
                continue
            try:
                target.write_bytes(admin.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
            except ClientError:
                target.write_bytes(b"")


def _ledger(run_dir: Path) -> dict[str, tuple[str, str]]:
    """key -> (used | dropped | quarantined, reason) from every ledger entry and quarantine record."""
    out: dict[str, tuple[str, str]] = {}
    for path in (run_dir / "quarantine").rglob("*.json"):
        record = json.loads(path.read_text() or "{}")
        out[record.get("key", "")] = ("quarantined", record.get("reason", ""))
    return {**out, **store_junk.ledger_outcomes(run_dir)}


def _used_after(run_dir: Path, after_step: int, until: int) -> dict[str, int]:
    """Files of each actor that steps ``after_step`` + 1 .. ``until`` used."""
    counts: dict[str, int] = {}
    for path in (run_dir / "ledger" / "consumed").glob("step-*.json"):
        step = layout.step_of_consumed_key(layout.LEDGER_CONSUMED + path.name)
        if step is None or not after_step < step <= until:
            continue
        for item in json.loads(path.read_text()).get("used", []):
            parsed = layout.parse_rollout_key(item["key"])
            if parsed:
                counts[parsed[1]] = counts.get(parsed[1], 0) + 1
    return counts


def judge(attacker: HostileActor, run_dir: Path, logs: str, resume_log: str, resume_code: int,
          marker: Path) -> dict:
    """Per kind: (detected, evidence). ``logs``: the learner's and actors' logs of both runs."""
    ledger = _ledger(run_dir)
    summary = json.loads((run_dir / "reports" / "summary.json").read_text()) \
        if (run_dir / "reports" / "summary.json").exists() else {}
    ban = summary.get("spot_check", {}).get("banned", {}).get(HOSTILE, "")
    ban_record = (run_dir / layout.ban_key(HOSTILE)).exists()

    def reasons(kind: str) -> list[tuple[str, str]]:
        """(status, reason) per key; a key neither in the ledger nor in the store was deleted by the janitor, which
        deletes only the files of a banned actor (so it counts only where the ban is recorded)."""
        return [ledger.get(k, ("cleared by the ban", "banned") if ban_record and not (run_dir / k).exists()
                           else ("not judged", "")) for k in attacker.keys[kind]]

    def quarantined_as(kind: str, pattern: re.Pattern) -> tuple[bool, str]:
        got = reasons(kind)
        ok = bool(got) and all(s == "quarantined" and pattern.search(r) and "banned" not in r for s, r in got)
        return ok, "; ".join(f"{s}: {r[:90]}" for s, r in got[:2])

    def peer_logged(kind: str, pattern: re.Pattern) -> tuple[bool, str]:
        """A log line that names the attacker's peer record and says what is wrong with it."""
        key = layout.peer_key(HOSTILE)
        lines = [line for line in logs.splitlines() if (key in line or HOSTILE in line) and "peer" in line]
        named = [line for line in lines if pattern.search(line.split(key)[-1])]
        return bool(named) and bool(attacker.keys[kind]), ((named or lines or ["no log line names it"])[0][-160:])

    out = {"glacier-rollout": quarantined_as("glacier-rollout", _UNREADABLE),
           "huge-object": quarantined_as("huge-object", _OVERSIZE),
           "glacier-peer": peer_logged("glacier-peer", _UNREADABLE), "huge-peer": peer_logged("huge-peer", _OVERSIZE)}
    hanging = reasons("hanging-math")
    out["hanging-math"] = (bool(hanging) and all(s == "quarantined" for s, _ in hanging)
                           and bool(_GRADING.search(ban) or all(_GRADING.search(r) and "banned" not in r
                                                                for _, r in hanging)),
                           f"ban: {ban[:90] or 'none'}; " + "; ".join(f"{s}: {r[:90]}" for s, r in hanging[:1]))
    settled = ("quarantined", "dropped", "cleared by the ban")
    future = reasons("future-versions")
    out["future-versions"] = (bool(future) and all(s in settled for s, _ in future)
                              and any(_FUTURE.search(r) or "banned" in r for _, r in future),
                              "; ".join(f"{s}: {r[:70]}" for s, r in future[:2]))
    junk = reasons("junk-flood")
    out["junk-flood"] = (bool(junk) and all(s in settled and s != "dropped" or r.startswith("banned")
                                            for s, r in junk),
                         f"{sum(s == 'quarantined' for s, _ in junk)}/{len(junk)} quarantined, "
                         f"{sum(s != 'quarantined' and s in settled for s, _ in junk)} cleared by the ban, "
                         f"{sum(s == 'used' for s, _ in junk)} used, "
                         f"{sum(s == 'not judged' for s, _ in junk)} not judged")
    planted = [line for line in resume_log.splitlines() if str(PLANTED_STEP) in line]
    refused = [line for line in planted if re.search(r"not loaded|not this run|ignored|refus|reject|forged|signature|"
                                                     r"not signed|skipp", line, re.I)]
    out["planted-checkpoint"] = (bool(refused) and (resume_code in (0, 2)),
                                 (refused or planted or ["no log line names it"])[0][-160:])
    pickled = [line for line in resume_log.splitlines() if str(PICKLE_STEP) in line
               and re.search(r"not loaded|not signed|signature|skipp|refus", line, re.I)]
    out["pickle-payload"] = (bool(pickled) and not marker.exists(),
                             ("the payload RAN: " if marker.exists() else "")
                             + (pickled or ["no log line names it"])[0][-160:])
    return out


def hostile_store(workdir: Path, quick: bool = False) -> dict:
    from transformers import AutoTokenizer

    from echo2.chaos.moto_iam import IamMoto
    from echo2.config import load_config
    from echo2.tasks import make_task

    model = h.tiny_model(workdir)
    marker = workdir / "planted-payload-ran"  # what the planted pickle would create
    run_id = f"hostile-{secrets.token_hex(3)}"  # its local logs go to ./echo2-logs/<run>: one per scenario run
    bucket, prefix = "echo2-hostile", "chaos"
    root = f"{prefix}/{layout.RUNS}/{run_id}/"
    cap = 80 if quick else 200  # the run is interrupted well before (``HostileActor.steps_after``)
    moto = IamMoto()
    try:
        learner_keys, scoped = moto.setup(bucket, prefix, run_id, HOSTILE)
        admin = moto.client("s3", learner_keys)
        tok = AutoTokenizer.from_pretrained(model)
        task = make_task(load_config(MATH, ["task.eval_size=10"]).task)
        attacker = HostileActor(moto.client("s3", scoped), admin, bucket, root, run_id=run_id, tokenizer=tok,
                                task=task, quick=quick)
        env = h.environment(workdir, **learner_keys, AWS_DEFAULT_REGION="us-east-1")
        args = ["run", MATH, *h.sets(f"model.name={model}", f"store.url=s3://{bucket}/{prefix}",
                                     f"store.options={{endpoint_url: {moto.url}}}", f"run.id={run_id}", *h.TINY,
                                     *MATH_TINY)]
        code = h.run_cli(args + h.sets(f"train.max_steps={cap}"), workdir, workdir / "hostile.log", env=env,
                         timeout=300 if quick else 1200, while_running=attacker.step)
        revoked = _revoked_in(admin, bucket, root)
        steps = _checkpoint_steps(admin, bucket, root)
        planted = plant_checkpoint(admin, bucket, root)
        pickled = plant_pickle(admin, bucket, root, f"touch {marker}")
        resume_code = h.run_cli(args + h.sets(f"train.max_steps={max(steps, default=0) + 3}", "fleet.actors=1")
                                + ["--resume"], workdir, workdir / "hostile-resume.log", env=env, timeout=300)
        mirror(admin, bucket, root, workdir / "mirror")
    finally:
        moto.stop()
    run_dir = workdir / "mirror" / root
    local_logs = h.REPO / layout.REMOTE_LOCAL_DIR / run_id
    if local_logs.exists():  # the actors' logs, beside the mirror (the learner's are the run_cli logs)
        shutil.copytree(local_logs / layout.LOGS, run_dir / layout.LOGS, dirs_exist_ok=True)
        shutil.rmtree(local_logs, ignore_errors=True)
    row = audit_row("hostile-store", run_dir, resume_code)
    learner_log, resume_log = ((workdir / n).read_text(errors="replace") for n in ("hostile.log", "hostile-resume.log"))
    actor_logs = "\n".join(p.read_text(errors="replace") for p in (run_dir / layout.LOGS).glob("*.log"))
    kinds = judge(attacker, run_dir, learner_log + "\n" + resume_log + "\n" + actor_logs, resume_log, resume_code,
                  marker)
    leg = store_junk.resume_leg(workdir, model, tok, task, math_config=MATH, sets=[*h.TINY, *MATH_TINY], quick=quick)
    kinds.update(leg["kinds"])

    broken = list(leg["broken"])
    if marker.exists():
        broken.append(f"the pickle planted in checkpoint step-{PICKLE_STEP} ran")
    if attacker.wave < 3:
        broken.append(f"the run ended before the attacker's wave {attacker.wave + 1} of 3")
    resumed_at = min([e["ts"] for e in _events(run_dir) if e.get("kind") == "resume"], default=float("inf"))
    honest = _honest_actors(run_dir, before=resumed_at)  # the attacked run's actors, not the resume's
    used = _used_after(run_dir, attacker.first_upload_step or 0, until=attacker.interrupted_at or cap)
    starved = {a: used.get(a, 0) for a in honest if not used.get(a)}
    if not honest or starved:
        broken.append(f"honest actors with no file used after the first hostile upload: {starved or 'no actors'}")
    summary = json.loads((run_dir / "reports" / "summary.json").read_text()) if row["finished"] else {}
    banned = HOSTILE in summary.get("spot_check", {}).get("banned", {})
    if attacker.checkpoint_refused == "allowed":
        broken.append("the actor's own credentials were allowed to write a checkpoint manifest")
    if not (banned and revoked):
        broken.append(f"hostile actor banned: {banned}, revoked in a published manifest: {revoked}")
    resumed = [e for e in _events(run_dir) if e.get("kind") == "resume"]
    planted_loaded = any(e.get("step") == PLANTED_STEP for e in resumed) or any(
        (layout.parse_version_dir(p.name) or 0) >= PLANTED_STEP for p in (run_dir / "policy").glob("v*"))
    detected = sum(ok for ok, _ in kinds.values())
    return result_row("hostile-store", injected=len(KINDS), detected=detected, lost=row["lost"] + leg["lost"],
                      bad_loaded=bad_loads(run_dir) + int(planted_loaded) + int(marker.exists()),
                      finished=code == 130 and resume_code == 0 and row["finished"] and leg["finished"],
                      broken=broken, first_collection_s=leg["first_collection_s"],
                      leaks=h.leaks(workdir, [workdir / "mirror", workdir / "local-store"],
                                    extra=[learner_keys["AWS_SECRET_ACCESS_KEY"], scoped["AWS_SECRET_ACCESS_KEY"]]),
                      kinds={k: {"detected": ok, "evidence": why} for k, (ok, why) in kinds.items()},
                      detail=f"run exit {code} (130: interrupted as planned at step {attacker.interrupted_at}), "
                             f"checkpoint step-{PLANTED_STEP} planted ({planted}), step-{PICKLE_STEP} ({pickled}), "
                             f"resume exit {resume_code}; {leg['detail']}; "
                             f"detected: "
                             f"{', '.join(k for k, (ok, _) in kinds.items() if ok) or 'none'}; missed: "
                             + "; ".join(f"{k} ({why})" for k, (ok, why) in kinds.items() if not ok)
                             + f"; honest files used after the first upload: {used}; its own credentials planting a "
                               f"checkpoint: {attacker.checkpoint_refused or 'not tried'}; GLACIER puts the store "
                               f"refused (then made with wider credentials): {attacker.store_refused or 'none'}"
                             + (f"; broken: {broken}" if broken else ""))


def _checkpoint_steps(admin, bucket: str, root: str) -> list[int]:
    found = admin.list_objects_v2(Bucket=bucket, Prefix=root + layout.CHECKPOINTS).get("Contents", [])
    return sorted({layout.parse_step_dir(o["Key"][len(root):].split("/")[1]) or 0 for o in found
                   if o["Key"].endswith("/" + layout.MANIFEST)})


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text() or "{}") for p in (run_dir / "ledger" / "events").glob("*.json")]


def _honest_actors(run_dir: Path, before: float) -> set[str]:
    return {str(e["actor_id"]) for e in _events(run_dir)
            if e.get("kind") == "launch" and e.get("actor_id") != HOSTILE and e.get("ts", 0) < before}


def _revoked_in(admin, bucket: str, root: str) -> bool:
    """Whether a published version's signed manifest revokes the hostile actor."""
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root + layout.POLICY):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith("/" + layout.MANIFEST):
                manifest = json.loads(admin.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
                if HOSTILE in manifest.get("revoked", []):
                    return True
    return False
