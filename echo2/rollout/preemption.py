"""Moved to ``echo2/preemption.py`` (the learner's notice uses it too, and the learner never imports the rollout
plane); the actor's imports of this name keep working."""

from echo2.preemption import (  # noqa: F401
    AWS_TOKEN_TTL_S,
    CLUSTER_INFO_ENV,
    DEFAULT_ENDPOINTS,
    ENDPOINT_ENV,
    SOURCE_ENV,
    SOURCES,
    MetadataProbe,
    Notice,
    PreemptionWatcher,
    machine_cloud,
    resolve,
    start_watcher,
)
