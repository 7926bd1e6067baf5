"""`remote_error`: what a failed `ray.get` of a trainer's or replica's call is raised as, without Ray running."""

import ray

from refit.errors import InvalidTensorError, LifecycleError
from refit.transport.object_store import remote_error


def test_refits_own_error_comes_back_as_raised_and_any_other_keeps_rays_traceback():
    refused = LifecycleError("trainer rank 0: sync A was refused: this trainer's ranks are streaming sync B")
    relayed = remote_error(ray.exceptions.RayTaskError("stream_buckets", "Traceback ...\n  File x", refused), "trainer rank 0",
                           "stream_buckets")
    assert relayed is refused and str(relayed).startswith("trainer rank 0: sync A was refused")

    bug = remote_error(ray.exceptions.RayTaskError("stream_buckets", "Traceback ...\n  File x", KeyError("w")), "the trainer",
                       "stream_buckets")
    assert isinstance(bug, KeyError) and isinstance(bug, ray.exceptions.RayTaskError) and "File x" in str(bug)

    nan = InvalidTensorError("refusing to send any weight:\n  model.norm.weight: holds NaN or Inf")
    assert remote_error(ray.exceptions.RayTaskError("load_bucket", "tb", nan), "rollout 0", "load_bucket") is nan
