"""moto's S3, IAM and STS on 127.0.0.1 with IAM enforcement on, in a process of its own: the store of a
chaos scenario where an actor holds its own scoped credentials (``scenarios/hostile_store.py``).

A process of its own because moto keeps its auth switch (``/moto-api/reset-auth``) per process, shared by
every in-process server: switched on in the suite's process, it would lock out the other scenarios'
servers, which run beside this one without auth.

Two limits of moto 5.2.5 shape the set-up (``tests/e2e/test_credentials.py`` rests on the same facts):

- it ignores session policies, so the actor's scoped document is put on a role of its own as the role's
  inline policy, and the actor's STS session of that role is what it gets (``credentials.scoped_credentials``);
- it turns an IAM wildcard into a regex by replacing ``*`` only (``?``, used by the rollout pattern, breaks
  the regex), so the child process replaces that one matcher with AWS's documented semantics;
- it ignores ``Condition``: the actor policy's condition that only STANDARD, unencrypted-by-customer-key
  objects may be written (``credentials.READABLE_WRITES``) is not enforced, so this store lets through a
  GLACIER object as a store without it would (GCS, an older policy); what the learner does with that is
  what the scenario tests. A *conditional* Deny would be applied to every request: any such statement is
  left out of the role here.

    python -m echo2.chaos.moto_iam     # prints the port, serves until its stdin closes
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
import uuid

ADMIN = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


def _aws_match(pattern: str, value: str):
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, re.DOTALL)


def main() -> None:
    from moto.iam.access_control import IAMPolicyStatement
    from moto.server import ThreadedMotoServer

    IAMPolicyStatement._match = staticmethod(_aws_match)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    print(f"\n{server.get_host_and_port()[1]}", flush=True)
    sys.stdin.read()  # the parent closed it (or died): stop
    server.stop()


def enforceable(policy: dict) -> dict:
    """``policy`` without the conditional Deny statements moto would apply unconditionally (module doc)."""
    return {**policy, "Statement": [s for s in policy["Statement"]
                                    if not (s.get("Effect") == "Deny" and s.get("Condition"))]}


class IamMoto:
    """The child process; ``setup`` makes the bucket, the learner's user and one actor's scoped role, then
    switches auth on."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "echo2.chaos.moto_iam"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        port = ""
        for line in self.proc.stdout:  # moto announces itself first: the port is the first line of digits
            if line.strip().isdigit():
                port = line.strip()
                break
        if not port:
            self.stop()
            raise RuntimeError("moto's server did not start")
        self.url = f"http://127.0.0.1:{port}"

    def client(self, service: str, keys: dict[str, str] | None = None):
        import boto3

        keys = keys or {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        return boto3.client(service, endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
                            aws_session_token=keys.get("AWS_SESSION_TOKEN"))

    def setup(self, bucket: str, prefix: str, run_id: str, actor_id: str) -> tuple[dict[str, str], dict[str, str]]:
        """(the learner's keys: an admin user, as the operator runs it; the actor's scoped session keys)."""
        from echo2.fleet import credentials

        s3, iam = self.client("s3"), self.client("iam")
        s3.create_bucket(Bucket=bucket)
        user = f"learner-{uuid.uuid4().hex[:6]}"
        user_arn = iam.create_user(UserName=user)["User"]["Arn"]
        iam.put_user_policy(UserName=user, PolicyName="admin", PolicyDocument=json.dumps(ADMIN))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        learner = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"AWS": user_arn},
                                                         "Action": "sts:AssumeRole"}]}
        policy = credentials.actor_policy(bucket, prefix, run_id, actor_id)
        role_arn = iam.create_role(RoleName=f"echo2-actor-{uuid.uuid4().hex[:6]}",
                                   AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
        iam.put_role_policy(RoleName=role_arn.rsplit("/", 1)[1], PolicyName="scope",
                            PolicyDocument=json.dumps(enforceable(policy)))
        request = urllib.request.Request(f"{self.url}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=10).read()
        scoped = credentials.scoped_credentials(self.client("sts", learner), role_arn, policy, actor_id,
                                                credentials.MIN_DURATION_S)
        return learner, scoped.env

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    main()
