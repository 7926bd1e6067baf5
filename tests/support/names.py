"""Names of actors that another driver process looks up (`ray.get_actor(name, namespace=NAMESPACE)`)."""

NAMESPACE = "refit-tests"
SHARED_REPLICAS = ("shared-rollout-1", "shared-rollout-2")  # conftest's `shared_replicas`
