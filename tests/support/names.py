"""Names of actors that another driver process looks up (`ray.get_actor(name, namespace=NAMESPACE)`)."""

import os

# Per pytest-xdist worker: the workers share one cluster, and each has its own shared replicas.
NAMESPACE = f"refit-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
SHARED_REPLICAS = ("shared-rollout-1", "shared-rollout-2")  # conftest's `shared_replicas`
